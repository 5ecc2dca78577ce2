"""Whatever a client sends, the server answers 2xx or 4xx with a reason, and keeps serving.

Requests are generated from the server's own OpenAPI document (`GET /openapi.json`, built from
the pydantic models that validate the bodies) by schemathesis: bodies that fit the schema
(positive) and bodies that break it (negative: wrong types, missing fields, out-of-place
values), then Hypothesis-built raw bodies (any bytes, JSON of any shape and depth). Every answer
must be below 500, a 4xx must carry an OpenAI error object with a message, a stream must hold
no server error event, and `/health` must answer after each. The server is real (uvicorn, the
batching engine on the tiny Llama with a byte tokenizer) and capped at a few new tokens per
request (`max_tokens`), so a generated request that is valid costs little.

The suite runs a few hundred requests; `SPECPORT_FUZZ_EXAMPLES=5000` (with `-m slow`) runs the
long version (`test_fuzz_long`).
"""

from __future__ import annotations

import json
import os
from typing import Any

import httpx
import pytest

from tests.runtime.serve.helpers import CHAT_TEMPLATE, serve

schemathesis = pytest.importorskip("schemathesis", reason="the fuzz tests need schemathesis (dev)")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402

NAME = "bytes"
CAP = 4  # new tokens per request: every valid generated request stays cheap
EXAMPLES = int(os.environ.get("SPECPORT_FUZZ_EXAMPLES", "0"))


@pytest.fixture(scope="module")
def fuzz_server(bytes_batching):
    from specport.runtime.engine import make_engine

    model, _ = bytes_batching
    engine = make_engine(model, max_batch=4, kind="batching")
    server = serve(model, engine, model_name=NAME, chat_template=CHAT_TEMPLATE, max_tokens=CAP)
    yield server
    server.stop()
    engine.close()


@pytest.fixture(scope="module")
def api(fuzz_server) -> Any:
    """The served OpenAPI document, with `model` pinned to the served name so generated
    bodies get past the model check to the rules behind it (negative mode still breaks it)."""
    doc = httpx.get(fuzz_server.url + "/openapi.json").json()
    vocab = fuzz_server.app.state.specport.served.vocab_size
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = doc["components"]["schemas"][name]["properties"]
        props["model"] = {"const": NAME}
        for field in ("max_tokens", "max_completion_tokens"):
            if field in props:
                props[field]["anyOf"][0]["maximum"] = CAP  # this server's --max-tokens
        for form in props.get("prompt", {}).get("anyOf", []):
            if form.get("items", {}).get("type") == "integer":
                form["items"]["maximum"] = vocab - 1
    return schemathesis.openapi.from_dict(doc)


def check(server: Any, resp: Any, sent: Any) -> None:
    """The answer is not a server error; a refusal says why; the server still serves."""
    status = resp.status_code
    assert status < 500, (status, sent, resp.text[:500])
    if status >= 400:
        err = resp.json()["error"]
        assert err["message"] and "Traceback" not in err["message"], err
    elif "text/event-stream" in str(resp.headers.get("content-type", "")):
        assert '"server_error"' not in resp.text, (sent, resp.text[:500])
    health = httpx.get(server.url + "/health", timeout=30)
    assert health.status_code == 200


def _run_schema(api: Any, server: Any, mode: GenerationMode, examples: int) -> None:
    seen: dict[int, int] = {}

    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=api.as_strategy(mode))
    def one(case: Any) -> None:
        resp = case.call(base_url=server.url, timeout=60)
        seen[resp.status_code] = seen.get(resp.status_code, 0) + 1
        if os.environ.get("SPECPORT_FUZZ_SHOW") and resp.status_code >= 400:
            print(resp.status_code, resp.text[:160])
        check(server, resp, (case.method, case.path, case.body))

    one()
    print(mode, dict(sorted(seen.items())))
    assert sum(seen.values()) >= min(examples, 50), seen  # it did send requests


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_schema_fuzz(api, fuzz_server, mode):
    _run_schema(api, fuzz_server, mode, 100)


def _post(server: Any, raw: bytes) -> httpx.Response:
    return httpx.post(
        server.url + "/v1/chat/completions",
        content=raw,
        headers={"Content-Type": "application/json"},
        timeout=60,
    )


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=20,
)
# bodies close to valid ones: the real field names, values of any type
near_bodies = st.fixed_dictionaries(
    {},
    optional={
        k: json_values
        for k in (
            "model", "messages", "max_tokens", "temperature", "top_p", "top_k", "stop", "n",
            "stream", "logit_bias", "seed", "logprobs", "top_logprobs", "response_format",
            "stream_options", "presence_penalty", "guided_regex", "max_completion_tokens",
        )
    },
)  # fmt: skip


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(raw=st.binary(max_size=200) | json_values.map(lambda v: json.dumps(v).encode()))
def test_any_bytes_get_an_answer(fuzz_server, raw):
    check(fuzz_server, _post(fuzz_server, raw), raw)


@settings(
    max_examples=80,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
@given(body=near_bodies)
def test_near_valid_bodies_get_an_answer(fuzz_server, body):
    body = {"messages": [{"role": "user", "content": "hi"}], "model": NAME, **body}
    check(fuzz_server, _post(fuzz_server, json.dumps(body).encode()), body)


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (b"[" * 5000 + b"]" * 5000, "nested more than 64 levels"),
        (b'{"a": ' * 5000 + b"1" + b"}" * 5000, "nested more than 64 levels"),
        (b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', "not valid UTF-8"),
        (b'{"messages": [], "temperature": NaN}', "not valid JSON"),
        (b'{"messages": [], "temperature": Infinity}', "not valid JSON"),
    ],
    ids=["array-5000-deep", "object-5000-deep", "invalid-utf8", "nan", "infinity"],
)
def test_malformed_bodies_are_400(fuzz_server, raw, words):
    resp = _post(fuzz_server, raw)
    assert resp.status_code == 400, resp.text
    assert words in resp.json()["error"]["message"]


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"stop": ["x"] * 10_000}, "stop may hold at most 4 strings, got 10000"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "at most 300 tokens"),
        ({"max_tokens": CAP + 1}, f"limit of {CAP} new tokens"),
        ({"max_tokens": 10**30}, f"limit of {CAP} new tokens"),
        ({"max_tokens": -1}, "at least 1"),
        ({"n": 17}, "n must be in 1..16"),
        ({"seed": -1}, "seed"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs must be in 0..20"),
        ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
    ],
)
def test_openai_limits(fuzz_server, extra, words):
    body = {"messages": [{"role": "user", "content": "hi"}], "model": NAME, **extra}
    resp = _post(fuzz_server, json.dumps(body).encode())
    assert resp.status_code == 400, resp.text
    assert words in resp.json()["error"]["message"], resp.json()


def test_max_tokens_default_is_the_operators(fuzz_server):
    body = {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}
    resp = _post(fuzz_server, json.dumps(body).encode())
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == CAP


@pytest.mark.slow
@pytest.mark.skipif(not EXAMPLES, reason="set SPECPORT_FUZZ_EXAMPLES=N for the long fuzz run")
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_fuzz_long(api, fuzz_server, mode):
    _run_schema(api, fuzz_server, mode, EXAMPLES)
