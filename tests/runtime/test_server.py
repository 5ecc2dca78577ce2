"""The OpenAI-compatible server over real HTTP, a real engine and real exported artifacts.

The tiny Llama artifact has no tokenizer, so its tests send token-id prompts and compare token
ids; text, streaming text and chat templates are checked on stories260K (shared folder, slow:
its export takes ~15 s).
"""

from __future__ import annotations

import http.client
import json
import shutil
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import specport
from specport.runtime.engine.base import Event, Request, RequestHandle
from specport.runtime.server import SpecportServer, make_server

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def _make_engine(model: Any) -> Any:
    from specport.runtime.engine import make_engine

    return make_engine(model, max_batch=4, kind="auto")


@pytest.fixture(scope="module")
def tiny_model(tiny_llama_artifact: Path) -> Any:
    return specport.load(tiny_llama_artifact, threads=1)


@pytest.fixture(scope="module")
def tiny_server(tiny_model: Any):
    engine = _make_engine(tiny_model)
    server = make_server(tiny_model, engine, port=0, model_name="tiny", max_body_bytes=64 * 1024)
    server.start()
    yield server
    server.stop()
    engine.close()


@pytest.fixture(scope="module")
def batching(tiny_zoo: Any, tmp_path_factory: pytest.TempPathFactory):
    """The tiny Llama exported with the shared KV layout: make_engine picks continuous batching."""
    from specport.exporter.export import export_model

    art = tmp_path_factory.mktemp("serve_shared") / "art"
    export_model(tiny_zoo.source("llama"), art, kv_layout="shared", progress=False)
    model = specport.load(art, threads=1)
    engine = _make_engine(model)
    server = make_server(model, engine, port=0)
    server.start()
    yield model, server
    server.stop()
    engine.close()


@pytest.fixture(scope="module")
def stories(shared_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """stories260K served with a (test-only) chat template added to its artifact."""
    from specport.exporter.export import export_model

    src = shared_dir / "models" / "stories260K"
    if not (src / "config.json").exists():
        pytest.skip(f"stories260K not found under {shared_dir}")
    art = tmp_path_factory.mktemp("serve_s260") / "s260"
    export_model(src, art, fuse=False, skip_verify=True, progress=False)
    (art / "chat_template.jinja").write_text(CHAT_TEMPLATE)  # not hashed: not in the manifest
    model = specport.load(art, threads=1)
    engine = _make_engine(model)
    server = make_server(model, engine, port=0, model_name="s260")
    server.start()
    yield model, server
    server.stop()
    engine.close()


# ---------------------------------------------------------------------------- HTTP helpers


def _conn(server: SpecportServer) -> http.client.HTTPConnection:
    host, port = server.server_address[:2]
    return http.client.HTTPConnection(host, port, timeout=60)


def _call(
    server: SpecportServer,
    method: str,
    path: str,
    body: Any = None,
    raw: bytes | None = None,
    conn: http.client.HTTPConnection | None = None,
) -> tuple[int, dict[str, Any]]:
    c = conn or _conn(server)
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    headers = {"Content-Type": "application/json"} if data is not None else {}
    c.request(method, path, body=data, headers=headers)
    resp = c.getresponse()
    payload = resp.read()
    if conn is None:
        c.close()
    return resp.status, json.loads(payload)


def _stream(server: SpecportServer, path: str, body: dict[str, Any]) -> list[Any]:
    """The SSE `data:` payloads of a streamed answer, "[DONE]" included as a string."""
    c = _conn(server)
    c.request("POST", path, body=json.dumps({**body, "stream": True}))
    resp = c.getresponse()
    assert resp.status == 200
    assert resp.getheader("Content-Type", "").startswith("text/event-stream")
    events = []
    for block in resp.read().decode().split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    c.close()
    return events


def _assert_error(status: int, body: dict[str, Any], want: int, *words: str) -> None:
    assert status == want, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    for w in words:
        assert w in err["message"], err["message"]
    assert "Traceback" not in err["message"]


# ---------------------------------------------------------------------------- tiny model


def test_health_and_models(tiny_server):
    status, body = _call(tiny_server, "GET", "/health")
    assert status == 200 and body["status"] == "ok" and body["model"] == "tiny"
    status, body = _call(tiny_server, "GET", "/v1/models")
    assert status == 200 and body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["tiny"]
    assert body["data"][0]["object"] == "model" and body["data"][0]["max_model_len"] == 128


def test_completion_greedy_equals_generate(tiny_server, tiny_model):
    prompt = [1, 17, 42, 99, 5]
    ref = tiny_model.generate(prompt_ids=prompt, max_new_tokens=12, greedy=True, ignore_eos=True)
    status, body = _call(
        tiny_server,
        "POST",
        "/v1/completions",
        {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True},
    )
    assert status == 200, body
    assert body["object"] == "text_completion" and body["model"] == "tiny"
    assert body["id"].startswith("cmpl-") and isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert choice["token_ids"] == ref.tokens  # no tokenizer: ids are returned
    assert choice["finish_reason"] == "length" and choice["index"] == 0
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17}


def test_stream_token_ids_equal_whole(tiny_server):
    req = {"prompt": [1, 7, 8, 9], "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    _, whole = _call(tiny_server, "POST", "/v1/completions", req)
    events = _stream(
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


def test_sampling_seed_is_reproducible(tiny_server):
    req = {"prompt": [1, 3, 5], "max_tokens": 8, "temperature": 0.9, "top_k": 20, "seed": 7}
    a = _call(tiny_server, "POST", "/v1/completions", req)[1]["choices"][0]["token_ids"]
    b = _call(tiny_server, "POST", "/v1/completions", req)[1]["choices"][0]["token_ids"]
    assert a == b and len(a) >= 1


def test_context_finish_maps_to_length(tiny_server):
    status, body = _call(
        tiny_server,
        "POST",
        "/v1/completions",
        {"prompt": [1] * 120, "max_tokens": 50, "temperature": 0, "ignore_eos": True},
    )
    assert status == 200, body
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 128 - 120


def test_chat_without_template_is_400(tiny_server):
    status, body = _call(
        tiny_server,
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}]},
    )
    _assert_error(status, body, 400, "no chat template", "/v1/completions")


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
        ({"prompt": [1, 2], "n": 2}, ["n=2 is not supported"]),
        ({"prompt": [1, 2], "echo": True}, ["echo is not supported"]),
        ({"prompt": [1, 99999]}, ["outside the vocabulary"]),
        ({"prompt": "text"}, ["no tokenizer", "token ids"]),
        ({"prompt": [1, 2], "max_tokens": 0}, ["at least 1"]),
        ({}, ["prompt is required"]),
    ],
)
def test_bad_input_is_400(tiny_server, body, words):
    status, out = _call(tiny_server, "POST", "/v1/completions", body)
    _assert_error(status, out, 400, *words)


def test_routing_and_body_errors(tiny_server):
    _assert_error(
        *_call(tiny_server, "POST", "/v1/completions", raw=b"{not json"), 400, "not valid JSON"
    )
    _assert_error(*_call(tiny_server, "POST", "/v1/completions", raw=b"[1, 2]"), 400, "JSON object")
    _assert_error(*_call(tiny_server, "GET", "/v1/nothing"), 404, "no route")
    _assert_error(*_call(tiny_server, "GET", "/v1/models/other"), 404, "'other' does not exist")
    assert _call(tiny_server, "GET", "/v1/models/tiny")[1]["id"] == "tiny"
    _assert_error(*_call(tiny_server, "GET", "/v1/completions"), 405, "POST")
    _assert_error(*_call(tiny_server, "POST", "/health", {}), 405, "GET")
    status, body = _call(tiny_server, "POST", "/v1/completions", {"model": "gpt-4", "prompt": [1]})
    _assert_error(status, body, 404, "'tiny'")
    big = json.dumps({"prompt": [1] * 40000}).encode()  # > the fixture's 64 KiB limit
    _assert_error(
        *_call(tiny_server, "POST", "/v1/completions", raw=big), 413, "at most 65536 bytes"
    )


def test_oversized_body_is_refused_unread(tiny_server):
    """A huge Content-Length is answered 413 at once, without waiting for the body."""
    host, port = tiny_server.server_address[:2]
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 999999999\r\n\r\n{"
        )
        reply = s.recv(4096).decode()
    assert reply.startswith("HTTP/1.1 413"), reply


def test_bad_request_then_good_on_one_connection(tiny_server, tiny_model):
    c = _conn(tiny_server)
    _assert_error(
        *_call(tiny_server, "POST", "/v1/completions", {"prompt": []}, conn=c), 400, "empty"
    )
    req = {"prompt": [1, 4, 4], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    status, body = _call(tiny_server, "POST", "/v1/completions", req, conn=c)
    c.close()
    ref = tiny_model.generate(prompt_ids=[1, 4, 4], max_new_tokens=6, ignore_eos=True)
    assert status == 200 and body["choices"][0]["token_ids"] == ref.tokens


def test_concurrent_requests_all_answered(tiny_server, tiny_model):
    prompts = [[1, 10 + i, 20 + 2 * i, 30 + 3 * i] for i in range(6)]
    refs = [
        tiny_model.generate(prompt_ids=p, max_new_tokens=16, ignore_eos=True).tokens
        for p in prompts
    ]
    results: dict[int, Any] = {}

    def one(i: int) -> None:
        req = {"prompt": prompts[i], "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        if i % 2:
            events = _stream(tiny_server, "/v1/completions", req)
            results[i] = [t for e in events[:-1] for t in e["choices"][0].get("token_ids", [])]
        else:
            results[i] = _call(tiny_server, "POST", "/v1/completions", req)[1]["choices"][0][
                "token_ids"
            ]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert [results.get(i) for i in range(len(prompts))] == refs


@pytest.mark.slow
def test_batching_engine_concurrent_greedy(batching):
    """Eight clients at once through continuous batching: each gets its own greedy tokens."""
    model, server = batching
    assert type(server.engine).__name__ == "BatchingEngine"
    prompts = [[1, 10 + i, 20 + 2 * i, 30 + 3 * i][: 2 + i % 3] for i in range(8)]
    refs = [
        model.generate(prompt_ids=p, max_new_tokens=20, ignore_eos=True).tokens for p in prompts
    ]
    results: dict[int, Any] = {}

    def one(i: int) -> None:
        req = {"prompt": prompts[i], "max_tokens": 20, "temperature": 0, "ignore_eos": True}
        if i % 2:
            events = _stream(server, "/v1/completions", req)
            results[i] = [t for e in events[:-1] for t in e["choices"][0].get("token_ids", [])]
        else:
            results[i] = _call(server, "POST", "/v1/completions", req)[1]["choices"][0]["token_ids"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert [results.get(i) for i in range(len(prompts))] == refs
    assert server.stats()["engine"]


def test_client_disconnect_mid_stream_keeps_serving(tiny_server, tiny_model):
    host, port = tiny_server.server_address[:2]
    body = json.dumps(
        {
            "prompt": [1, 2, 3],
            "max_tokens": 120,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
    )
    s = socket.create_connection((host, port), timeout=10)
    s.sendall(
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode()
    )
    assert s.recv(64).startswith(b"HTTP/1.1 200")
    s.close()
    status, out = _call(
        tiny_server,
        "POST",
        "/v1/completions",
        {"prompt": [1, 2], "max_tokens": 4, "temperature": 0},
    )
    assert status == 200 and len(out["choices"][0]["token_ids"]) >= 1
    # The abandoned stream's handler thread notices the closed socket at its next write and
    # then leaves; give it a moment instead of racing it.
    deadline = time.monotonic() + 10
    while True:
        _, health = _call(tiny_server, "GET", "/health")
        if health["active"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert health["status"] == "ok" and health["active"] == 0


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
    server = make_server(tiny_model, _FailingEngine(), port=0)
    server.start()
    try:
        status, body = _call(server, "POST", "/v1/completions", {"prompt": [1, 2]})
        _assert_error(status, body, 500, "onnxruntime fell over")
        assert body["error"]["type"] == "server_error"
        events = _stream(server, "/v1/completions", {"prompt": [1, 2]})
        assert events[-1] == "[DONE]" and "onnxruntime fell over" in events[-2]["error"]["message"]
        assert _call(server, "GET", "/health")[0] == 200
    finally:
        server.stop()


# ---------------------------------------------------------------------------- text (stories260K)


@pytest.mark.slow
@pytest.mark.shared
def test_text_completion_and_stream(stories):
    model, server = stories
    prompt = "Once upon a time"
    ref = model.generate(prompt, max_new_tokens=40, greedy=True)
    req = {"prompt": prompt, "max_tokens": 40, "temperature": 0}
    status, body = _call(server, "POST", "/v1/completions", req)
    assert status == 200, body
    text = body["choices"][0]["text"]
    assert text == ref.text and len(text) > 20
    assert "token_ids" not in body["choices"][0]  # only on request when there is a tokenizer
    assert body["usage"]["prompt_tokens"] == len(model.encode(prompt))
    assert body["usage"]["completion_tokens"] == len(ref.tokens)
    events = _stream(server, "/v1/completions", req)
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == text
    assert events[-2]["choices"][0]["finish_reason"] == body["choices"][0]["finish_reason"]


@pytest.mark.slow
@pytest.mark.shared
def test_stop_string(stories):
    model, server = stories
    full = _call(
        server,
        "POST",
        "/v1/completions",
        {"prompt": "Once upon a time", "max_tokens": 40, "temperature": 0},
    )
    text = full[1]["choices"][0]["text"]
    word = text.split()[3]
    status, body = _call(
        server, "POST", "/v1/completions",
        {"prompt": "Once upon a time", "max_tokens": 40, "temperature": 0, "stop": [word]},
    )  # fmt: skip
    assert status == 200
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["text"] == text[: text.index(word)]


@pytest.mark.slow
@pytest.mark.shared
def test_chat_with_template(stories):
    model, server = stories
    messages = [{"role": "user", "content": "Tell me a story about a cat."}]
    rendered = "<s>user: Tell me a story about a cat.\nassistant:"
    prompt_ids = model.tokenizer.encode(rendered, add_special_tokens=False).ids
    ref = model.generate(prompt_ids=prompt_ids, max_new_tokens=24, greedy=True)
    req = {"model": "s260", "messages": messages, "max_tokens": 24, "temperature": 0}
    status, body = _call(server, "POST", "/v1/chat/completions", req)
    assert status == 200, body
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    message = body["choices"][0]["message"]
    assert message == {"role": "assistant", "content": ref.text}
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)
    events = _stream(server, "/v1/chat/completions", req)
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
    before = server.stats()["cancelled"]
    host, port = server.server_address[:2]
    body = json.dumps(
        {"prompt": "Once", "max_tokens": 500, "temperature": 0, "ignore_eos": True, "stream": True}
    )
    s = socket.create_connection((host, port), timeout=10)
    s.sendall(
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode()
    )
    got = b""
    while b"data: " not in got:
        got += s.recv(4096)
    s.close()  # unread data: the close resets the connection, the server's next write fails
    deadline = time.time() + 20
    while server.stats()["cancelled"] == before and time.time() < deadline:
        time.sleep(0.05)
    assert server.stats()["cancelled"] == before + 1
    status, out = _call(
        server, "POST", "/v1/completions", {"prompt": "Once", "max_tokens": 5, "temperature": 0}
    )
    assert status == 200 and out["choices"][0]["text"]


@pytest.mark.slow
@pytest.mark.shared
def test_disconnect_cancels_waiting_whole_answer(stories):
    """A non-streamed request whose client left is cancelled, not generated to the end."""
    model, server = stories
    before = server.stats()["cancelled"]
    host, port = server.server_address[:2]
    body = json.dumps({"prompt": "Once", "max_tokens": 500, "temperature": 0, "ignore_eos": True})
    s = socket.create_connection((host, port), timeout=10)
    s.sendall(
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode()
    )
    s.close()
    deadline = time.time() + 20
    while server.stats()["cancelled"] == before and time.time() < deadline:
        time.sleep(0.05)
    assert server.stats()["cancelled"] == before + 1
    assert server.stats()["engine"]["cancelled"] >= 1
    assert _call(server, "GET", "/health")[0] == 200


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
    ],
)
def test_malformed_http_gets_json_error(tiny_server, raw):
    host, port = tiny_server.server_address[:2]
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(raw)
        reply = b""
        while chunk := s.recv(4096):
            reply += chunk
    text = reply.decode()
    if text.startswith("HTTP/"):  # a bare "GARBAGE" line is HTTP/0.9: a body, no status line
        head, _, text = text.partition("\r\n\r\n")
        assert head.split()[1] in ("400", "501", "505"), head
    assert set(json.loads(text)["error"]) == {"message", "type", "param", "code"}
    assert _call(tiny_server, "GET", "/health")[0] == 200


# ---------------------------------------------------------------------------- chat template files


@pytest.fixture(scope="module")
def s260_tokenizer(shared_dir: Path) -> Any:
    from tokenizers import Tokenizer

    path = shared_dir / "models" / "stories260K" / "tokenizer.json"
    if not path.is_file():
        pytest.skip(f"shared stories260K tokenizer not found at {path}")
    return Tokenizer.from_file(str(path))


@pytest.mark.shared
def test_chat_template_from_tokenizer_config(tmp_path, s260_tokenizer):
    """HF's tokenizer_config.json forms: a list of named templates, special tokens as dicts."""
    from types import SimpleNamespace

    from specport.errors import InputError
    from specport.runtime.chat_template import load_chat_template

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


def test_engine_kv_length_bounds_the_prompt(batching):
    """`serve --max-model-len`: the server refuses (400, with the limit) what the engine's rows
    cannot hold, instead of failing inside the engine."""
    from specport.runtime.engine import make_engine

    model, _ = batching
    engine = make_engine(model, max_batch=2, kind="batching", max_length=32)
    server = make_server(model, engine, port=0)
    server.start()
    try:
        status, body = _call(server, "POST", "/v1/completions", {"prompt": [1] * 40})
        _assert_error(status, body, 400, "32", "at most 31 tokens")
        status, body = _call(
            server,
            "POST",
            "/v1/completions",
            {"prompt": [1] * 20, "max_tokens": 50, "temperature": 0},
        )
        assert status == 200 and body["usage"]["completion_tokens"] == 32 - 20
    finally:
        server.stop()
        engine.close()


def test_speculative_serving_equals_plain_greedy(tiny_model):
    """`serve --speculative ngram`: the answer is plain greedy's, token for token."""
    from specport.runtime.engine import make_engine

    engine = make_engine(tiny_model, speculative="ngram", num_draft=3)
    server = make_server(tiny_model, engine, port=0)
    server.start()
    try:
        prompt = [1, 7, 8, 9, 7, 8]
        want = tiny_model.generate(prompt_ids=prompt, max_new_tokens=12, ignore_eos=True).tokens
        status, body = _call(
            server,
            "POST",
            "/v1/completions",
            {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True},
        )
        assert status == 200 and body["choices"][0]["token_ids"] == want
        _, health = _call(server, "GET", "/health")
        assert health["engine"]["speculative"] == "ngram"
    finally:
        server.stop()
        engine.close()
