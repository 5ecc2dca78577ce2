"""Real HTTP against a real uvicorn server on 127.0.0.1: httpx for raw calls, the official
`openai` client for what users write."""

from __future__ import annotations

import json
import socket
import threading
from typing import Any

import httpx

from specport.runtime.serve.app import make_app
from specport.runtime.serve.server import Server
from specport.runtime.serve.state import ServeSettings

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def serve(model: Any, engine: Any, **settings: Any) -> Server:
    """A started server over `engine` on a free port (stop it with `.stop()`)."""
    return Server(make_app(model, engine, ServeSettings(**settings)), port=0).start()


def state(server: Server) -> Any:
    return server.app.state.specport


def openai_client(server: Server, api_key: str = "unused") -> Any:
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=api_key, max_retries=0, timeout=60)


def call(
    server: Server,
    method: str,
    path: str,
    body: Any = None,
    raw: bytes | None = None,
    client: httpx.Client | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, Any]]:
    c = client or httpx.Client(base_url=server.url, timeout=60)
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    hdrs = {"Content-Type": "application/json"} if data is not None else {}
    resp = c.request(method, path, content=data, headers={**hdrs, **(headers or {})})
    if client is None:
        c.close()
    return resp.status_code, resp.json()


def stream(server: Server, path: str, body: dict[str, Any]) -> list[Any]:
    """The SSE `data:` payloads of a streamed answer, "[DONE]" included as a string."""
    events: list[Any] = []
    with httpx.Client(base_url=server.url, timeout=60) as c:
        with c.stream("POST", path, json={**body, "stream": True}) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            text = resp.read().decode()
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def concurrent_completions(
    server: Server, prompts: list[list[int]], max_tokens: int
) -> list[list[int] | None]:
    """Greedy completions of `prompts`, all sent at once from their own threads, every other
    one streamed: each prompt's token ids (None where no answer came)."""
    results: dict[int, list[int]] = {}

    def one(i: int) -> None:
        req = {"prompt": prompts[i], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        if i % 2:
            events = stream(server, "/v1/completions", req)
            results[i] = [t for e in events[:-1] for t in e["choices"][0].get("token_ids", [])]
        else:
            results[i] = call(server, "POST", "/v1/completions", req)[1]["choices"][0]["token_ids"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return [results.get(i) for i in range(len(prompts))]


def raw_socket(server: Server, timeout: float = 10) -> socket.socket:
    return socket.create_connection(server.address, timeout=timeout)


def read_reply(s: socket.socket) -> str:
    """One whole HTTP reply from a raw socket: the headers, then as much body as its
    Content-Length says (the server may write them in separate segments), or up to EOF."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(4096)
        if not chunk:
            return data.decode()
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        (int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
         if line.lower().startswith(b"content-length:")),
        None,
    )  # fmt: skip
    while length is None or len(body) < length:
        chunk = s.recv(4096)
        if not chunk:
            break
        body += chunk
    return (head + b"\r\n\r\n" + body).decode()


def assert_error(status: int, body: dict[str, Any], want: int, *words: str) -> None:
    assert status == want, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    for w in words:
        assert w in err["message"], err["message"]
    assert "Traceback" not in err["message"]
