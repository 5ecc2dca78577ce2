"""`specport serve`: load errors exit 1 with a message; a real process serves (the official
`openai` client against it), logs one line per request, and stops cleanly on Ctrl-C or SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import Any

import httpx
import openai
import pytest

from specport.cli import main


def test_missing_artifact_exits_1(capsys, tmp_path):
    assert main(["serve", str(tmp_path / "nothing"), "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err


def test_unknown_provider_is_a_usage_error(capsys, tiny_llama_artifact):
    with pytest.raises(SystemExit) as e:
        main(["serve", str(tiny_llama_artifact), "--provider", "tpu", "--port", "0"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--provider" in err and "tpu" in err and "Traceback" not in err


def test_bad_port_exits_1(capsys, tiny_llama_artifact):
    assert main(["serve", str(tiny_llama_artifact), "--port", "70000"]) == 1
    assert "--port" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags",
    [
        ["--max-tokens", "0"],
        ["--max-queue", "0"],
        ["--request-timeout", "-1"],
        ["--prefill-stall", "1"],
    ],
    ids=lambda f: f[0],
)
def test_bad_serving_limits_exit_1(capsys, tiny_llama_artifact, flags):
    """Checked before the model loads: one line naming the flag, no traceback."""
    assert main(["serve", str(tiny_llama_artifact), *flags]) == 1
    err = capsys.readouterr().err
    assert flags[0] in err and "Traceback" not in err


def _start(artifact, *extra: str) -> tuple[subprocess.Popen, dict]:
    cmd = [sys.executable, "-m", "specport", "serve", str(artifact)]
    cmd += ["--port", "0", "--threads", "1", "--model-name", "tiny", "--json", *extra]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ)
    )
    line = proc.stdout.readline()  # written once the socket is bound
    if not line:
        proc.kill()
        raise AssertionError(proc.communicate()[1])
    return proc, json.loads(line)


def _stop(proc: subprocess.Popen, sig: int) -> str:
    proc.send_signal(sig)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode == 0, err
    return err


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_serves_then_stops_cleanly(tiny_llama_artifact, sig):
    proc, info = _start(tiny_llama_artifact)
    try:
        assert info["model"] == "tiny" and info["url"].startswith("http://127.0.0.1:")
        assert httpx.get(info["url"] + "/health", timeout=30).status_code == 200
        client = openai.OpenAI(base_url=info["url"] + "/v1", api_key="x", max_retries=0)
        out = client.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=4, temperature=0)
        assert out.model == "tiny" and out.usage.prompt_tokens == 3
        assert "vllm:e2e_request_latency_seconds" in httpx.get(info["url"] + "/metrics").text
    finally:
        err = _stop(proc, sig)
    assert "serving tiny at http://127.0.0.1:" in err and "shutting down" in err
    assert "Traceback" not in err
    access = [line for line in err.splitlines() if "route=/v1/completions" in line]
    assert len(access) == 1, err
    for field in (
        f"id={out.id}",
        "status=200",
        "prompt_tokens=3",
        "completion_tokens=",
        "ttft_ms=",
        "total_ms=",
        "finish=",
    ):
        assert field in access[0], access[0]


def test_api_key_and_cors_off(tiny_llama_artifact):
    proc, info = _start(tiny_llama_artifact, "--api-key", "s3cret")
    try:
        bad = openai.OpenAI(base_url=info["url"] + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError, match="API key"):
            bad.models.list()
        r = httpx.post(info["url"] + "/v1/completions", json={"prompt": [1], "max_tokens": 1})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(info["url"] + "/health").status_code == 200  # probes need no key
        good = openai.OpenAI(base_url=info["url"] + "/v1", api_key="s3cret", max_retries=0)
        assert good.models.list().data[0].id == "tiny"
        # CORS stays off unless asked
        pre = httpx.options(
            info["url"] + "/v1/models",
            headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "GET"},
        )
        assert "access-control-allow-origin" not in pre.headers
    finally:
        _stop(proc, signal.SIGINT)


def test_suffix_record_keeps_learned_answers_across_restarts(tiny_llama_artifact, tmp_path):
    """Every answer suffix drafting learns is appended to --suffix-record (after what the file
    held); a process given that file as its corpus drafts the same question from it, with
    plain greedy's tokens."""
    import specport

    record = tmp_path / "learned.jsonl"
    record.write_text('{"ids": [7, 8, 9]}')  # an earlier record, its last newline lost
    prompts = [[1, 2, 3], [4, 5, 6]]
    model = specport.load(tiny_llama_artifact)
    plain = [model.generate(prompt_ids=p, max_new_tokens=12).tokens for p in prompts]
    proc, info = _start(
        tiny_llama_artifact, "--speculative", "suffix", "--suffix-record", str(record)
    )
    try:
        client = openai.OpenAI(base_url=info["url"] + "/v1", api_key="x", max_retries=0)
        for p in prompts:
            client.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0)
    finally:
        err = _stop(proc, signal.SIGINT)
    assert "Traceback" not in err
    lines = [json.loads(line)["ids"] for line in record.read_text().splitlines()]
    assert lines == [[7, 8, 9], *plain]
    restored = specport.load(tiny_llama_artifact, suffix_corpus=record)
    assert len(restored.suffix_index) == 3 + sum(len(t) for t in plain) + 3
    again = restored.generate(prompt_ids=prompts[1], max_new_tokens=12, speculative="suffix")
    assert again.tokens == plain[1] and again.metrics["speculative"]["accepted"] > 0


@pytest.mark.parametrize(
    "extra, code, words",
    [
        (["--suffix-record", "r.jsonl"], 2, "--suffix-record keeps what --speculative suffix"),
        (["--suffix-corpus", "c.jsonl"], 2, "--suffix-corpus is read only by --speculative"),
        (["--speculative", "suffix", "--suffix-record", "{dir}"], 1, "is not a file"),
        (["--speculative", "suffix", "--suffix-record", "{dir}/no/r.jsonl"], 1, "does not exist"),
    ],
)
def test_suffix_record_mistakes(capsys, tiny_llama_artifact, tmp_path, extra, code, words):
    args = [a.format(dir=tmp_path) for a in extra]
    assert main(["serve", str(tiny_llama_artifact), "--port", "0", *args]) == code
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err


def test_chat_template_file_errors_exit_1(capsys, tiny_llama_artifact, tmp_path):
    art = str(tiny_llama_artifact)
    rc = main(["serve", art, "--port", "0", "--chat-template", str(tmp_path / "no.jinja")])
    assert rc == 1
    err = capsys.readouterr().err
    assert "cannot read --chat-template" in err and "Traceback" not in err
    (tmp_path / "t.jinja").write_text("{{ messages[0]['content'] }}")
    rc = main(["serve", art, "--port", "0", "--chat-template", str(tmp_path / "t.jinja")])
    assert rc == 1
    err = capsys.readouterr().err
    assert "needs a tokenizer" in err and "Traceback" not in err


def test_batching_engine_on_concat_artifact_exits_1(capsys, tiny_llama_artifact):
    rc = main(["serve", str(tiny_llama_artifact), "--engine", "batching", "--port", "0"])
    assert rc == 1
    err = capsys.readouterr().err
    assert "--kv-layout shared" in err and "--out OUT" in err and "Traceback" not in err


def test_port_in_use_exits_1(capsys, tiny_llama_artifact):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        assert main(["serve", str(tiny_llama_artifact), "--port", str(port)]) == 1
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and "--port" in err


N = 16  # choices per request: 16 engine requests of 120 tokens each


def _load(url: str, i: int) -> tuple[str, Any]:
    """One long request of a load (even i: streamed): ("ok", tokens) when it finished,
    ("error", message) when the server failed it with an OpenAI error, ("dropped", why) else."""
    body = {"prompt": [1, 2, 3], "max_tokens": 120, "temperature": 0, "ignore_eos": True, "n": N}
    try:
        with httpx.Client(timeout=60) as c:
            if i % 2:
                r = c.post(url + "/v1/completions", json=body)
                data = r.json()  # the whole reply, whatever its status
                if r.status_code == 200:
                    return "ok", [c["token_ids"] for c in data["choices"]]
                assert r.status_code == 503, data
                return "error", data["error"]["message"]
            tokens: list[list[int]] = [[] for _ in range(N)]
            with c.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
                if r.status_code == 503:  # sent after the drain began: refused, not started
                    return "error", json.loads(r.read())["error"]["message"]
                assert r.status_code == 200
                events = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
            assert events[-1] == "[DONE]", events[-3:]
            for event in map(json.loads, events[:-1]):
                if "error" in event:
                    return "error", event["error"]["message"]
                for choice in event["choices"]:
                    tokens[choice["index"]] += choice.get("token_ids") or []
            return "ok", tokens
    except httpx.TransportError as e:
        return "dropped", repr(e)


@pytest.mark.slow
def test_sigterm_under_load_drains_then_exits_0(tiny_llama_artifact):
    """SIGTERM while requests are running and queued (serial engine): each one either finishes
    whole (every choice the same tokens as alone) or is failed with an OpenAI error once --drain-timeout passes; none is cut
    off, the process exits 0 soon after, and the log has no traceback."""
    import threading
    import time

    proc, info = _start(tiny_llama_artifact, "--drain-timeout", "0.5")
    url = info["url"]
    results: dict[int, tuple[str, Any]] = {}
    try:
        _, alone = _load(url, 1)
        threads = [
            threading.Thread(target=lambda i=i: results.__setitem__(i, _load(url, i)))
            for i in range(12)
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # wait until the engine is busy with the load
            health = httpx.get(url + "/health", timeout=30).json()
            if health["active"] >= 2:
                break
            time.sleep(0.02)
        t0 = time.monotonic()
    finally:
        err = _stop(proc, signal.SIGTERM)
    took = time.monotonic() - t0
    for t in threads:
        t.join(timeout=60)
    assert took < 0.5 + 5 + 10, took  # drain timeout + grace, with room for a loaded machine
    assert "Traceback" not in err and "shutting down" in err, err
    assert len(results) == 12, results
    kinds = sorted(kind for kind, _ in results.values())
    assert "error" in kinds, kinds  # 192 x 120 tokens one at a time outlast the drain
    for kind, value in results.values():
        assert kind in ("ok", "error"), (kind, value)
        if kind == "ok":
            assert value == alone
        else:
            assert "shutting down" in value
