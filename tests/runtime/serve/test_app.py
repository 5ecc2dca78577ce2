"""The OpenAI-compatible server over real HTTP (uvicorn on 127.0.0.1), a real engine and real
exported artifacts, driven by the official `openai` client and by httpx for raw HTTP.

The tiny Llama artifact has no tokenizer, so its tests send token-id prompts and compare token
ids; text, streaming text and chat templates are checked on stories260K (shared folder, slow:
its export takes ~15 s).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

import specport
from specport.runtime.engine.base import Event, Request, RequestHandle
from tests.runtime.serve.helpers import (
    CHAT_TEMPLATE,
    assert_error,
    call,
    concurrent_completions,
    openai_client,
    raw_socket,
    read_reply,
    serve,
    state,
    stream,
)

# ---------------------------------------------------------------------------- tiny model


def test_health_and_models(tiny_server):
    status, body = call(tiny_server, "GET", "/health")
    assert status == 200 and body["status"] == "ok" and body["model"] == "tiny"
    status, body = call(tiny_server, "GET", "/v1/models")
    assert status == 200 and body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["tiny"]
    assert body["data"][0]["object"] == "model" and body["data"][0]["max_model_len"] == 128
    models = openai_client(tiny_server).models.list()
    assert [m.id for m in models.data] == ["tiny"] and models.data[0].max_model_len == 128


def test_completion_greedy_equals_generate(tiny_server, tiny_model):
    prompt = [1, 17, 42, 99, 5]
    ref = tiny_model.generate(prompt_ids=prompt, max_new_tokens=12, greedy=True, ignore_eos=True)
    out = openai_client(tiny_server).completions.create(
        model="tiny", prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.object == "text_completion" and out.model == "tiny"
    assert out.id.startswith("cmpl-") and isinstance(out.created, int)
    (choice,) = out.choices
    assert choice.token_ids == ref.tokens  # no tokenizer: ids are returned
    assert choice.finish_reason == "length" and choice.index == 0
    assert out.usage.model_dump(include={"prompt_tokens", "completion_tokens", "total_tokens"}) == {
        "prompt_tokens": 5,
        "completion_tokens": 12,
        "total_tokens": 17,
    }


def test_stream_token_ids_equal_whole(tiny_server):
    req = {"prompt": [1, 7, 8, 9], "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    _, whole = call(tiny_server, "POST", "/v1/completions", req)
    events = stream(
        tiny_server, "/v1/completions", {**req, "stream_options": {"include_usage": True}}
    )
    assert events[-1] == "[DONE]"
    usage, chunks = events[-2], events[:-2]
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]
    ids = [t for c in chunks for t in c["choices"][0].get("token_ids", [])]
    assert ids == whole["choices"][0]["token_ids"]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    # the official client reads the same stream
    client = openai_client(tiny_server)
    got = []
    for chunk in client.completions.create(
        model="tiny",
        stream=True,
        extra_body={"ignore_eos": True},
        **{k: v for k, v in req.items() if k != "ignore_eos"},
    ):
        got.extend(getattr(chunk.choices[0], "token_ids", None) or [])
    assert got == ids


def test_sampling_seed_is_reproducible(tiny_server):
    client = openai_client(tiny_server)
    req = {"prompt": [1, 3, 5], "max_tokens": 8, "temperature": 0.9, "seed": 7}
    a = client.completions.create(model="tiny", extra_body={"top_k": 20}, **req).choices[0]
    b = client.completions.create(model="tiny", extra_body={"top_k": 20}, **req).choices[0]
    assert a.token_ids == b.token_ids and len(a.token_ids) >= 1


def test_max_tokens_beyond_context_is_400(tiny_server):
    """A max_tokens that cannot fit beside the prompt is refused with the limit, not capped."""
    status, body = call(
        tiny_server,
        "POST",
        "/v1/completions",
        {"prompt": [1] * 120, "max_tokens": 50, "temperature": 0, "ignore_eos": True},
    )
    assert_error(status, body, 400, "max_tokens=50", "at most 8 new tokens", "128")
    assert body["error"]["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match="at most 8 new tokens"):
        openai_client(tiny_server).completions.create(model="tiny", prompt=[1] * 120, max_tokens=50)


def test_default_max_tokens_fills_the_context(tiny_server):
    status, body = call(
        tiny_server,
        "POST",
        "/v1/completions",
        {"prompt": [1] * 120, "temperature": 0, "ignore_eos": True},
    )
    assert status == 200, body
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 128 - 120


def test_chat_without_template_is_400(tiny_server):
    status, body = call(
        tiny_server,
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}]},
    )
    assert_error(status, body, 400, "no chat template", "/v1/completions", "--chat-template")


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"prompt": [1, 2], "max_tokens": "many"}, ["max_tokens must be an integer"]),
        ({"prompt": [1, 2], "temperature": "hot"}, ["temperature must be a number"]),
        ({"prompt": {"a": 1}}, ["prompt must be"]),
        ({"prompt": [1, 2], "stop": 3}, ["stop must be"]),
        ({"prompt": [1] * 300}, ["128", "at most 127 tokens"]),
        ({"prompt": [1, 2], "top_p": 2.0}, ["top_p must be in (0, 1]"]),
        ({"prompt": [1, 2], "temperature": 0.5, "top_k": -3}, ["top_k must be >= 0"]),
        ({"prompt": [1, 2], "n": 0}, ["n must be in 1..16"]),
        ({"prompt": [1, 2], "suffix": "x"}, ["suffix", "not supported"]),
        ({"prompt": [1, 2], "logit_bias": {"x": 1}}, ["logit_bias keys must be token ids"]),
        ({"prompt": [1, 2], "presence_penalty": 3}, ["presence_penalty must be in [-2, 2]"]),
        ({"prompt": [1, 99999]}, ["outside the vocabulary"]),
        ({"prompt": "text"}, ["no tokenizer", "token ids"]),
        ({"prompt": [1, 2], "max_tokens": 0}, ["at least 1"]),
        ({"prompt": [1, 2], "max_tokens": True}, ["max_tokens must be an integer"]),
        ({}, ["prompt is required"]),
    ],
)
def test_bad_input_is_400(tiny_server, body, words):
    status, out = call(tiny_server, "POST", "/v1/completions", body)
    assert_error(status, out, 400, *words)


def test_routing_and_body_errors(tiny_server):
    assert_error(
        *call(tiny_server, "POST", "/v1/completions", raw=b"{not json"), 400, "not valid JSON"
    )
    assert_error(*call(tiny_server, "POST", "/v1/completions", raw=b"[1, 2]"), 400, "JSON object")
    assert_error(*call(tiny_server, "GET", "/v1/nothing"), 404, "no route")
    assert_error(*call(tiny_server, "GET", "/v1/models/other"), 404, "'other' does not exist")
    assert call(tiny_server, "GET", "/v1/models/tiny")[1]["id"] == "tiny"
    assert_error(*call(tiny_server, "GET", "/v1/completions"), 405, "POST")
    assert_error(*call(tiny_server, "POST", "/health", {}), 405, "GET")
    status, body = call(tiny_server, "POST", "/v1/completions", {"model": "gpt-4", "prompt": [1]})
    assert_error(status, body, 404, "'tiny'")
    big = b'{"prompt": [' + b"1, " * 40000 + b"1]}"  # > the fixture's 64 KiB limit
    assert_error(*call(tiny_server, "POST", "/v1/completions", raw=big), 413, "at most 65536 bytes")


def test_oversized_body_is_refused_unread(tiny_server):
    """A huge Content-Length is answered 413 at once, without waiting for the body."""
    with raw_socket(tiny_server) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 999999999\r\n\r\n{"
        )
        reply = read_reply(s)
    assert reply.startswith("HTTP/1.1 413"), reply


def test_bad_request_then_good_on_one_connection(tiny_server, tiny_model):
    with httpx.Client(base_url=tiny_server.url, timeout=60) as c:
        assert_error(
            *call(tiny_server, "POST", "/v1/completions", {"prompt": []}, client=c), 400, "empty"
        )
        req = {"prompt": [1, 4, 4], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        status, body = call(tiny_server, "POST", "/v1/completions", req, client=c)
    ref = tiny_model.generate(prompt_ids=[1, 4, 4], max_new_tokens=6, ignore_eos=True)
    assert status == 200 and body["choices"][0]["token_ids"] == ref.tokens


def test_concurrent_requests_all_answered(tiny_server, tiny_model):
    prompts = [[1, 10 + i, 20 + 2 * i, 30 + 3 * i] for i in range(6)]
    refs = [
        tiny_model.generate(prompt_ids=p, max_new_tokens=16, ignore_eos=True).tokens
        for p in prompts
    ]
    assert concurrent_completions(tiny_server, prompts, 16) == refs


@pytest.mark.slow
def test_batching_engine_concurrent_greedy(batching):
    """Eight clients at once through continuous batching: each gets its own greedy tokens."""
    model, server = batching
    assert type(state(server).engine).__name__ == "BatchingEngine"
    prompts = [[1, 10 + i, 20 + 2 * i, 30 + 3 * i][: 2 + i % 3] for i in range(8)]
    refs = [
        model.generate(prompt_ids=p, max_new_tokens=20, ignore_eos=True).tokens for p in prompts
    ]
    assert concurrent_completions(server, prompts, 20) == refs
    assert state(server).stats()["engine"]


def _wait(predicate: Any, seconds: float = 20) -> bool:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _post_raw(server: Any, body: dict[str, Any]) -> Any:
    import json

    data = json.dumps(body)
    s = raw_socket(server)
    s.sendall(
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\n\r\n{data}".encode()
    )
    return s


def test_client_disconnect_mid_stream_keeps_serving(tiny_server):
    s = _post_raw(
        tiny_server,
        {
            "prompt": [1, 2, 3],
            "max_tokens": 120,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        },
    )
    assert s.recv(64).startswith(b"HTTP/1.1 200")
    s.close()
    status, out = call(
        tiny_server,
        "POST",
        "/v1/completions",
        {"prompt": [1, 2], "max_tokens": 4, "temperature": 0},
    )
    assert status == 200 and len(out["choices"][0]["token_ids"]) >= 1
    assert _wait(lambda: state(tiny_server).counters["active"] == 0, 10)
    _, health = call(tiny_server, "GET", "/health")
    assert health["status"] == "ok" and health["active"] == 0


def test_truncated_body_times_out_without_holding_anything(tiny_model):
    """A body shorter than its Content-Length gets 408 after the body timeout (no traceback,
    no engine work); a client that hangs up halfway is dropped."""
    from specport.runtime.engine import make_engine

    engine = make_engine(tiny_model, kind="serial")
    server = serve(tiny_model, engine, body_timeout_s=0.5)
    try:
        with raw_socket(server) as s:
            s.sendall(
                b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"pro'
            )
            t0 = time.monotonic()
            reply = read_reply(s)
        assert reply.startswith("HTTP/1.1 408"), reply
        assert time.monotonic() - t0 < 10 and "did not arrive" in reply
        with raw_socket(server) as s:  # half a body, then gone
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        assert engine.stats()["requests"] == 0
        assert call(server, "GET", "/health")[0] == 200
    finally:
        server.stop()
        engine.close()


# ---------------------------------------------------------------------------- engine failures


class _FailingEngine:
    """An engine whose every request ends in an error event (the server must answer 500)."""

    def submit(self, request: Request) -> RequestHandle:
        handle = RequestHandle(request)
        handle.push(Event(finish_reason="error", error="onnxruntime fell over"))
        return handle

    def close(self) -> None:
        pass

    def stats(self) -> dict[str, float | int]:
        return {}


def test_engine_error_is_500_and_server_keeps_serving(tiny_model):
    server = serve(tiny_model, _FailingEngine())
    try:
        status, body = call(server, "POST", "/v1/completions", {"prompt": [1, 2]})
        assert_error(status, body, 500, "onnxruntime fell over")
        assert body["error"]["type"] == "server_error"
        with pytest.raises(openai.InternalServerError, match="onnxruntime fell over"):
            openai_client(server).completions.create(model=tiny_model.path.name, prompt=[1, 2])
        events = stream(server, "/v1/completions", {"prompt": [1, 2]})
        assert events[-1] == "[DONE]" and "onnxruntime fell over" in events[-2]["error"]["message"]
        assert call(server, "GET", "/health")[0] == 200
    finally:
        server.stop()


# ---------------------------------------------------------------------------- text (stories260K)


@pytest.mark.slow
@pytest.mark.shared
def test_text_completion_and_stream(stories):
    model, server = stories
    prompt = "Once upon a time"
    ref = model.generate(prompt, max_new_tokens=40, greedy=True)
    client = openai_client(server)
    out = client.completions.create(model="s260", prompt=prompt, max_tokens=40, temperature=0)
    text = out.choices[0].text
    assert text == ref.text and len(text) > 20
    assert getattr(out.choices[0], "token_ids", None) is None  # only on request with a tokenizer
    assert out.usage.prompt_tokens == len(model.encode(prompt))
    assert out.usage.completion_tokens == len(ref.tokens)
    pieces = list(
        client.completions.create(
            model="s260", prompt=prompt, max_tokens=40, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in pieces) == text
    assert pieces[-1].choices[0].finish_reason == out.choices[0].finish_reason


@pytest.mark.slow
@pytest.mark.shared
def test_stop_string(stories):
    model, server = stories
    client = openai_client(server)
    text = (
        client.completions.create(
            model="s260", prompt="Once upon a time", max_tokens=40, temperature=0
        )
        .choices[0]
        .text
    )
    word = text.split()[3]
    out = client.completions.create(
        model="s260", prompt="Once upon a time", max_tokens=40, temperature=0, stop=[word]
    )
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == text[: text.index(word)]


@pytest.mark.slow
@pytest.mark.shared
def test_chat_with_template(stories):
    model, server = stories
    messages = [{"role": "user", "content": "Tell me a story about a cat."}]
    rendered = "<s>user: Tell me a story about a cat.\nassistant:"
    prompt_ids = model.tokenizer.encode(rendered, add_special_tokens=False).ids
    ref = model.generate(prompt_ids=prompt_ids, max_new_tokens=24, greedy=True)
    client = openai_client(server)
    out = client.chat.completions.create(
        model="s260", messages=messages, max_tokens=24, temperature=0
    )
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref.text
    assert out.usage.prompt_tokens == len(prompt_ids)
    req = {"model": "s260", "messages": messages, "max_tokens": 24, "temperature": 0}
    events = stream(server, "/v1/chat/completions", req)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == ref.text
    assert chunks[-1]["choices"][0]["delta"] == {}
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.slow
@pytest.mark.shared
def test_disconnect_cancels_long_stream(stories):
    model, server = stories
    st = state(server)
    before = st.counters["cancelled"]
    s = _post_raw(
        server,
        {"prompt": "Once", "max_tokens": 500, "temperature": 0, "ignore_eos": True, "stream": True},
    )
    got = b""
    while b"data: " not in got:
        got += s.recv(4096)
    s.close()
    assert _wait(lambda: st.counters["cancelled"] == before + 1)
    out = openai_client(server).completions.create(
        model="s260", prompt="Once", max_tokens=5, temperature=0
    )
    assert out.choices[0].text


@pytest.mark.slow
@pytest.mark.shared
def test_disconnect_cancels_waiting_whole_answer(stories):
    """A non-streamed request whose client left is cancelled, not generated to the end."""
    model, server = stories
    st = state(server)
    before = st.counters["cancelled"]
    s = _post_raw(
        server, {"prompt": "Once", "max_tokens": 500, "temperature": 0, "ignore_eos": True}
    )
    s.close()
    assert _wait(lambda: st.counters["cancelled"] == before + 1)
    assert st.stats()["engine"]["cancelled"] >= 1
    assert call(server, "GET", "/health")[0] == 200


def test_chat_template_copy_is_not_hashed(tmp_path, tiny_llama_artifact):
    """Adding chat_template.jinja to an artifact keeps it loadable (the fixture above relies on it)."""
    art = tmp_path / "a"
    shutil.copytree(tiny_llama_artifact, art)
    (art / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    specport.load(art, threads=1)


@pytest.mark.parametrize(
    "raw",
    [
        b"GARBAGE\r\n\r\n",
        b"BREW /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET / HTTP/9.9\r\n\r\n",
        b"\x00\xff\xfe garbage \x01\r\n\r\n",
    ],
)
def test_malformed_http_gets_json_error(tiny_server, raw):
    import json

    with raw_socket(tiny_server) as s:
        s.sendall(raw)
        reply = b""
        while chunk := s.recv(4096):
            reply += chunk
    text = reply.decode()
    head, _, text = text.partition("\r\n\r\n")
    assert head.split()[1] in ("400", "405", "501", "505"), head
    assert set(json.loads(text)["error"]) == {"message", "type", "param", "code"}
    assert call(tiny_server, "GET", "/health")[0] == 200


def test_idle_connection_is_closed(tiny_model):
    from specport.runtime.engine import make_engine

    engine = make_engine(tiny_model, kind="serial")
    app_server = serve(tiny_model, engine)
    app_server.server.config.timeout_keep_alive = 1
    try:
        with raw_socket(app_server, timeout=20) as s:
            t0 = time.monotonic()
            assert s.recv(10) == b""  # the server hung up on a client that sent nothing
            assert time.monotonic() - t0 < 15
    finally:
        app_server.stop()
        engine.close()


# ---------------------------------------------------------------------------- chat template files


@pytest.fixture(scope="module")
def s260_tokenizer(shared_path: Callable[..., Path]) -> Any:
    from tokenizers import Tokenizer

    path = shared_path("models", "stories260K", "tokenizer.json")
    return Tokenizer.from_file(str(path))


@pytest.mark.shared
def test_chat_template_from_tokenizer_config(tmp_path, s260_tokenizer):
    """HF's tokenizer_config.json forms: a list of named templates, special tokens as dicts."""
    import json
    from types import SimpleNamespace

    from specport.core.chat_template import load_chat_template
    from specport.core.errors import InputError

    model = SimpleNamespace(path=tmp_path, tokenizer=s260_tokenizer)
    assert load_chat_template(model) is None  # no files: no template
    template = (
        "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}"
        "{% endif %}{{ bos_token }}{{ m['content'] }}{{ eos_token }}{% endfor %}"
    )
    config = {
        "bos_token": {"content": "<s>", "lstrip": False},
        "eos_token": "</s>",
        "chat_template": [
            {"name": "tool_use", "template": "x"},
            {"name": "default", "template": template},
        ],
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    chat = load_chat_template(model)
    assert chat is not None
    ids = chat.render_ids(
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    )
    want = s260_tokenizer.encode("<s>Hi</s><s>Yo</s>", add_special_tokens=False).ids
    assert (
        ids == want and ids[0] == 1 and ids.count(1) == 2
    )  # BOS from the template, not added twice
    with pytest.raises(InputError, match="no tools"):
        chat.render_ids([{"role": "tool", "content": "x"}])
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")  # file wins
    assert load_chat_template(model).render([{"role": "user", "content": "A"}]) == "A"
    # --chat-template FILE wins over both
    assert load_chat_template(model, "X{{ eos_token }}").render([]) == "X</s>"


def test_engine_kv_length_bounds_the_prompt(batching):
    """`serve --max-model-len`: the server refuses (400, with the limit) what the engine's rows
    cannot hold, instead of failing inside the engine."""
    from specport.runtime.engine import make_engine

    model, _ = batching
    engine = make_engine(model, max_batch=2, kind="batching", max_length=32)
    server = serve(model, engine)
    try:
        status, body = call(server, "POST", "/v1/completions", {"prompt": [1] * 40})
        assert_error(status, body, 400, "32", "at most 31 tokens")
        status, body = call(
            server,
            "POST",
            "/v1/completions",
            {"prompt": [1] * 20, "max_tokens": 50, "temperature": 0},
        )
        assert_error(status, body, 400, "32", "at most 12 new tokens")
        assert call(server, "GET", "/v1/models")[1]["data"][0]["max_model_len"] == 32
        status, body = call(
            server,
            "POST",
            "/v1/completions",
            {"prompt": [1] * 20, "max_tokens": 12, "temperature": 0, "ignore_eos": True},
        )
        assert status == 200 and body["usage"]["completion_tokens"] == 12
    finally:
        server.stop()
        engine.close()


def test_speculative_serving_equals_plain_greedy(tiny_model):
    """`serve --speculative ngram`: the answer is plain greedy's, token for token."""
    from specport.runtime.engine import make_engine

    engine = make_engine(tiny_model, speculative="ngram", num_draft=3)
    server = serve(tiny_model, engine)
    try:
        prompt = [1, 7, 8, 9, 7, 8]
        want = tiny_model.generate(prompt_ids=prompt, max_new_tokens=12, ignore_eos=True).tokens
        status, body = call(
            server,
            "POST",
            "/v1/completions",
            {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True},
        )
        assert status == 200 and body["choices"][0]["token_ids"] == want
        _, health = call(server, "GET", "/health")
        assert health["engine"]["speculative"] == "ngram"
    finally:
        server.stop()
        engine.close()


def test_metrics_agree_with_the_clients_counts(tiny_model):
    """/metrics scrapes in Prometheus format under vLLM's names, and counts what clients got."""
    from prometheus_client.parser import text_string_to_metric_families

    from specport.runtime.engine import make_engine

    engine = make_engine(tiny_model, kind="serial")
    server = serve(tiny_model, engine, model_name="m")
    try:
        client = openai_client(server)
        got = 0
        for i in range(3):
            out = client.completions.create(
                model="m",
                prompt=[1, 5 + i],
                max_tokens=4 + i,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            got += out.usage.completion_tokens
        for _ in client.completions.create(
            model="m",
            prompt=[1, 9],
            max_tokens=5,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        ):
            pass
        got += 5
        text = httpx.get(server.url + "/metrics").text
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
        }
        m = (("model_name", "m"),)
        assert samples[("vllm:generation_tokens_total", m)] == got
        assert samples[("vllm:prompt_tokens_total", m)] == 8
        assert samples[("vllm:request_success_total", (("finished_reason", "length"), *m))] == 4
        assert samples[("vllm:time_to_first_token_seconds_count", m)] == 4
        assert samples[("vllm:e2e_request_latency_seconds_count", m)] == 4
        assert ("vllm:num_requests_running", m) in samples
        assert ("vllm:num_requests_waiting", m) in samples
        assert samples[("vllm:inter_token_latency_seconds_count", m)] >= 0
    finally:
        server.stop()
        engine.close()


def test_oversized_headers_are_431(tiny_server):
    status, body = call(tiny_server, "GET", "/v1/models", headers={"X-Big": "a" * 70_000})
    assert_error(status, body, 431, "headers")
    assert call(tiny_server, "GET", "/health")[0] == 200


def test_speculative_batching_serving_feeds_spec_metrics(batching):
    """A shared-KV artifact with --speculative: the batching engine speculates per row, answers
    are plain greedy's, and /metrics counts drafted and accepted tokens under vLLM's names."""
    from prometheus_client.parser import text_string_to_metric_families

    from specport.runtime.engine import make_engine
    from specport.runtime.engine.batching import BatchingEngine

    model, _ = batching
    engine = make_engine(model, speculative="ngram", num_draft=3, spec_max_rows=8)
    assert isinstance(engine, BatchingEngine)
    server = serve(model, engine)
    try:
        prompt = [1, 7, 8, 9, 7, 8, 9, 7, 8]
        want = model.generate(prompt_ids=prompt, max_new_tokens=16, ignore_eos=True).tokens
        status, body = call(
            server,
            "POST",
            "/v1/completions",
            {"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True},
        )
        assert status == 200 and body["choices"][0]["token_ids"] == want
        samples = {
            s.name: s.value
            for fam in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)
            for s in fam.samples
        }
        drafted = samples["vllm:spec_decode_num_draft_tokens_total"]
        accepted = samples["vllm:spec_decode_num_accepted_tokens_total"]
        assert samples["vllm:spec_decode_num_drafts_total"] > 0
        assert drafted > 0 and 0 <= accepted <= drafted
        assert drafted == engine.stats()["spec_draft_tokens"]
    finally:
        server.stop()
        engine.close()


def test_batching_server_metrics_split_its_cpu_time(batching):
    """/metrics on the batching engine says where the server's CPU went: onnxruntime's decode
    steps and prompt runs, the engine's host work and the detokenizing thread, as counters
    (thread CPU seconds) that agree with the engine's own `stats()`."""
    from prometheus_client.parser import text_string_to_metric_families

    from specport.runtime.engine import make_engine

    model, _ = batching
    engine = make_engine(model)
    server = serve(model, engine)
    try:
        body = {"prompt": [1, 7, 8, 9], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        assert call(server, "POST", "/v1/completions", body)[0] == 200
        parts = {
            s.labels["part"]: s.value
            for fam in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)
            for s in fam.samples
            if s.name == "specport:engine_cpu_seconds_total"
        }
        assert set(parts) == {"decode_ort", "prefill_ort", "engine_host", "textout"}
        assert parts["decode_ort"] > 0 and parts["prefill_ort"] > 0
        assert min(parts.values()) >= 0
        stats = engine.stats()
        assert parts["decode_ort"] + parts["prefill_ort"] <= stats["engine_cpu_seconds"] + 1e-5
    finally:
        server.stop()
        engine.close()


def test_preempting_server_answers_each_token_once(batching):
    """`--preemption-mode recompute` on a KV space of two rows' first pages: requests are
    preempted and resumed, yet every client (streamed or not) gets its greedy tokens once
    each, and /metrics (vLLM's `num_preemptions`) and /health count the preemptions."""
    from prometheus_client.parser import text_string_to_metric_families

    from specport.runtime.engine import make_engine

    model, _ = batching
    engine = make_engine(model, kind="batching", kv_space=1)
    page = int(engine.kv.commit_bytes(1))
    span = next(n for n in range(1, engine.max_length) if engine.kv.commit_bytes(n) > page)
    engine.close()
    max_tokens = min(span + 8, engine.max_length - 12)  # past a row's first page
    prompts = [[1, *range(10 + i, 13 + 2 * i)] for i in range(6)]
    want = [
        model.generate(prompt_ids=p, max_new_tokens=max_tokens, ignore_eos=True).tokens
        for p in prompts
    ]
    engine = make_engine(model, kind="batching", kv_space=2 * page, preemption="recompute")
    server = serve(model, engine)
    try:
        assert concurrent_completions(server, prompts, max_tokens) == want
        samples = {
            s.name: s.value
            for fam in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)
            for s in fam.samples
        }
        health = httpx.get(server.url + "/health").json()["engine"]
        assert samples["vllm:num_preemptions_total"] == health["preemptions"] > 0
        assert health["preemption_mode"] == "recompute"
        assert samples["vllm:generation_tokens_total"] == len(prompts) * max_tokens
    finally:
        server.stop()
        engine.close()
