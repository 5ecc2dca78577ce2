"""specport serve beside llama-cpp-python's server: the same prompts and load on both, one table.

    specport loadtest --peer llama.cpp --artifact ART --gguf FILE.gguf \
        --concurrency 1,4,16,64 --requests 64 --max-tokens 64 --threads 2 [--out table.md]

Starts `specport serve ART --threads T` and `python -m llama_cpp.server --model FILE.gguf
--n_threads T` on free ports, waits until both answer, takes each server's own greedy answers
one request at a time (the references: the two models may differ, e.g. a Q4 GGUF against its
dequantized export, so each is held to its own), then runs every concurrency level on both,
one server at a time, alternating which goes first, so that a machine growing busier during
the run weighs on both alike. Both servers stop (SIGTERM) at the end, whatever happened.

llama-cpp-python's server answers one request at a time (its own lock; started with
`--interrupt_requests False`, else each new request cuts the running stream short and the
answers stop matching); its streams carry no
usage chunk, so its output tokens are counted one per streamed chunk (it streams a token per
chunk). Its `--model_alias` is set to specport's model name so one request body fits both.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from specport.bench.loadtest import client_for, level, prompts, references
from specport.core.errors import InputError

logger = logging.getLogger(__name__)

MODEL = "model"  # the name both servers answer to
START_TIMEOUT_S = 300.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Process:
    """A server subprocess whose output goes to a log file (shown when it fails to start)."""

    def __init__(self, name: str, cmd: list[str], port: int) -> None:
        self.name, self.url = name, f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - closed in stop()
            "w+", prefix=f"specport-peer-{name}-", suffix=".log", delete=False
        )
        logger.info("starting %s: %s (log: %s)", name, " ".join(cmd), self.log.name)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, path: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                if httpx.get(self.url + path, timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        self.log.flush()
        tail = Path(self.log.name).read_text(errors="replace")[-2000:]
        raise InputError(f"{self.name} did not start (see {self.log.name}):\n{tail}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def _specport(artifact: str, threads: int, extra: Sequence[str]) -> _Process:
    port = _free_port()
    cmd = [sys.executable, "-m", "specport", "serve", artifact, "--port", str(port)]
    cmd += ["--threads", str(threads), "--model-name", MODEL, "--no-access-log", *extra]
    return _Process("specport", cmd, port)


def _llamacpp(gguf: str, threads: int) -> _Process:
    port = _free_port()
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--n_threads", str(threads)]
    cmd += ["--port", str(port), "--host", "127.0.0.1", "--model_alias", MODEL]
    cmd += ["--interrupt_requests", "False"]  # its default cuts a stream when another arrives
    return _Process("llama.cpp", cmd, port)


async def _measure(
    servers: list[_Process], levels: list[int], requests: int, max_tokens: int
) -> list[dict[str, Any]]:
    texts = prompts(requests)
    clients = {s.name: client_for(s.url, "unused") for s in servers}
    refs = {}
    for s in servers:
        refs[s.name] = await references(clients[s.name], MODEL, texts, max_tokens)
    rows = []
    for i, c in enumerate(levels):
        order = servers if i % 2 == 0 else servers[::-1]
        for s in order:
            row = await level(clients[s.name], MODEL, texts, refs[s.name], c, max_tokens)
            row = {"server": s.name, **row}
            logger.info("%s", row)
            rows.append(row)
    for client in clients.values():
        await client.close()
    return sorted(rows, key=lambda r: (r["concurrency"], r["server"]))


def side_by_side(
    artifact: str,
    gguf: str,
    levels: list[int],
    requests: int,
    max_tokens: int,
    threads: int = 2,
    serve_args: Sequence[str] = (),
) -> dict[str, Any]:
    """Run the load on both servers (see the module docstring): `title` (what ran, with the
    load average after the run) and `rows` (one per server and concurrency level)."""
    for path in (artifact, gguf):
        if not os.path.exists(path):
            raise InputError(f"{path} does not exist")
    servers = [_specport(artifact, threads, serve_args), _llamacpp(gguf, threads)]
    try:
        servers[0].wait_ready("/health")
        servers[1].wait_ready("/v1/models")
        rows = asyncio.run(_measure(servers, levels, requests, max_tokens))
    finally:
        for s in servers:
            s.stop()
    load = os.getloadavg()
    head = (
        f"specport serve {artifact} vs llama-cpp-python server {Path(gguf).name}; "
        f"{threads} threads each, {requests} requests per level, max_tokens {max_tokens}, "
        f"greedy, streamed; load average after the run {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    )
    return {"title": head, "rows": rows}
