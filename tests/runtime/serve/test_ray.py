"""Scale-out on Ray Serve: the same app in two replicas (1 onnxruntime thread each) behind one
endpoint on a local Ray bound to 127.0.0.1. Answers equal single-process answers; killing one
replica under load fails only the requests it held, and the endpoint keeps serving."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import httpx
import pytest

from specport.runtime.serve.state import ServeSettings

pytestmark = pytest.mark.slow
ray = pytest.importorskip("ray", reason="Ray Serve is optional: pip install 'specport[ray]'")
serve = pytest.importorskip("ray.serve")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def endpoint(tiny_llama_artifact):
    from specport.ray_serve import deployment, run_deployment, start_local_ray

    start_local_ray(num_cpus=4)
    app = deployment(
        str(tiny_llama_artifact), ServeSettings(model_name="tiny"), replicas=2, threads=1
    )
    url = run_deployment(app, "127.0.0.1", _free_port())
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    yield url
    serve.shutdown()
    ray.shutdown()


def _complete(url: str, prompt: list[int], n: int = 24) -> httpx.Response:
    return httpx.post(
        url + "/v1/completions",
        json={
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": n,
            "temperature": 0,
            "ignore_eos": True,
        },
        timeout=120,
    )


def test_two_replicas_answer_as_one_process(endpoint, tiny_model):
    import openai

    client = openai.OpenAI(base_url=endpoint + "/v1", api_key="x", max_retries=0)
    prompts = [[1, 10 + i, 20 + i] for i in range(8)]
    results: dict[int, Any] = {}

    def one(i: int) -> None:
        out = client.completions.create(
            model="tiny",
            prompt=prompts[i],
            max_tokens=16,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        results[i] = out.choices[0].token_ids

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    want = [
        tiny_model.generate(prompt_ids=p, max_new_tokens=16, ignore_eos=True).tokens
        for p in prompts
    ]
    assert [results.get(i) for i in range(len(prompts))] == want


def _replicas() -> list[str]:
    """The replica actors' names, once there are two (Ray replaces a killed one)."""
    deadline = time.monotonic() + 180
    while True:
        names = [
            a["name"]
            for a in ray.util.list_named_actors(all_namespaces=True)
            if "SERVE_REPLICA" in a["name"] and "specport" in a["name"]
        ]
        if len(names) == 2 or time.monotonic() > deadline:
            return names
        time.sleep(1)


@pytest.mark.parametrize(
    ("how", "requests", "prompt"), [("ray.kill", 8, [1, 5, 6, 7]), ("SIGKILL", 12, [1, 8, 9, 10])]
)
def test_killing_a_replica_under_load_fails_only_its_requests(
    endpoint, tiny_model, how: str, requests: int, prompt: list[int]
):
    """One replica killed (Ray's own kill of its actor, or kill -9 of its process) while
    requests are in flight: each request either gets its exact answer or fails cleanly (an
    HTTP error status or a dropped connection, counted here), at least the other replica's
    succeed, and the endpoint keeps serving while Ray starts a new replica."""
    import os
    import signal

    names = _replicas()
    assert len(names) == 2, names
    for _ in range(4):  # both replicas serving
        assert _complete(endpoint, [1, 2, 3], 8).status_code == 200
    victim = ray.get_actor(names[0], namespace="serve")
    if how == "SIGKILL":
        pid = ray.get(victim.__ray_call__.remote(lambda self: os.getpid()), timeout=60)
    want = tiny_model.generate(prompt_ids=prompt, max_new_tokens=100, ignore_eos=True).tokens
    outcomes: list[Any] = []

    def one() -> None:
        try:
            r = _complete(endpoint, prompt, 100)
            outcomes.append(
                r.json()["choices"][0]["token_ids"] if r.status_code == 200 else r.status_code
            )
        except httpx.HTTPError as e:
            outcomes.append(type(e).__name__)

    threads = [threading.Thread(target=one) for _ in range(requests)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    if how == "SIGKILL":
        os.kill(pid, signal.SIGKILL)
    else:
        ray.kill(victim, no_restart=False)
    for t in threads:
        t.join(timeout=180)
    ok = [o for o in outcomes if o == want]
    failed = [o for o in outcomes if o != want]
    assert len(outcomes) == requests and ok, outcomes  # the other replica's answered exactly
    assert all(isinstance(o, (int, str)) for o in failed), failed  # failed, never wrong
    assert all(o >= 500 for o in failed if isinstance(o, int)), failed
    for _ in range(4):
        assert _complete(endpoint, [1, 2, 3], 8).status_code == 200
