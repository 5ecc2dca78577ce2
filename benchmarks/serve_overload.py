"""`specport serve` past its capacity (not a test): a sweep of arrival rates up to overload, with
the server's resident memory sampled from /metrics and its /ready answers counted.

    python -m benchmarks.serve_overload ART [--rates 0.5,1,2,4,8] [--requests 32]
        [--prompt-len 50:150] [--answer-len 32:64] [--threads 2]
        [--serve-arg=--max-queue=16 ...] [--json]

Starts `specport serve ART --port 0 --json` (plus `--serve-arg` flags), runs the open-loop
workload of `specport loadtest --rate` at each rate (specport/bench/workload.py), and reports per
rate the loadtest row, the largest resident memory seen (and the largest KV committed, from
`specport:kv_committed_bytes`) and how often /ready said 503. What
overload should look like: every request answered or refused (`http 503`, `http 504`), no other
error kind, memory flat, the server alive after. Quote the load average it prints.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from specport.bench import workload


def _rss_mb(url: str) -> float | None:
    try:
        text = httpx.get(url + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return None
    for line in text.splitlines():
        if line.startswith("process_resident_memory_bytes"):
            return float(line.split()[-1]) / 2**20
    return None


async def _watch(url: str, stop: asyncio.Event, seen: dict[str, Any]) -> None:
    async with httpx.AsyncClient(timeout=5) as client:
        while not stop.is_set():
            try:
                r = await client.get(url + "/ready")
                seen["ready"][r.status_code] = seen["ready"].get(r.status_code, 0) + 1
                m = await client.get(url + "/metrics")
                for line in m.text.splitlines():
                    if line.startswith("process_resident_memory_bytes"):
                        seen["rss_mb"] = max(seen["rss_mb"], float(line.split()[-1]) / 2**20)
                    elif line.startswith("specport:kv_committed_bytes"):
                        seen["kv_mb"] = max(seen["kv_mb"], float(line.split()[-1]) / 2**20)
            except httpx.HTTPError:
                seen["ready"]["unreachable"] = seen["ready"].get("unreachable", 0) + 1
            await asyncio.sleep(0.5)


async def _rate(
    url: str, model: str, rate: float, items: list[Any], slo_ttft_ms: float
) -> dict[str, Any]:
    seen: dict[str, Any] = {"ready": {}, "rss_mb": 0.0, "kv_mb": 0.0}
    stop = asyncio.Event()
    watcher = asyncio.create_task(_watch(url, stop, seen))
    client = workload.client_for(url, "unused")
    try:
        outcomes, wall = await workload.run_rate(client, model, items)
    finally:
        stop.set()
        await watcher
        await client.close()
    row = workload.summary(rate, outcomes, wall, slo_ttft_ms)
    row["rss_mb_max"] = round(seen["rss_mb"], 1)
    row["kv_committed_mb_max"] = round(seen["kv_mb"], 1)  # servers that report it
    row["ready"] = seen["ready"]
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact")
    ap.add_argument("--rates", default="0.5,1,2,4,8")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", default="50:150")
    ap.add_argument("--answer-len", default="32:64")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    ap.add_argument("--serve-arg", action="append", default=[])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    specport = str(Path(sys.executable).with_name("specport"))  # this environment's CLI
    cmd = [specport, "serve", args.artifact, "--port", "0", "--json"]
    cmd += ["--threads", str(args.threads), "--no-access-log", *args.serve_arg]
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        info = json.loads(server.stdout.readline())  # type: ignore[union-attr]
        url, model = info["url"], info["model"]
        rss_start = _rss_mb(url)
        rows = []
        for rate in [float(r) for r in args.rates.split(",")]:
            items = workload.build(
                args.requests, rate,
                workload.length_range(args.prompt_len, "--prompt-len"),
                workload.length_range(args.answer_len, "--answer-len"),
                seed=int(rate * 1000),
            )  # fmt: skip
            rows.append(asyncio.run(_rate(url, model, rate, items, args.slo_ttft_ms)))
            print(json.dumps(rows[-1]), flush=True)
        alive = httpx.get(url + "/health", timeout=30).status_code == 200
        report = {
            "rows": rows,
            "rss_mb_start": rss_start,
            "alive_after": alive,
            "load_average": os.getloadavg(),
            "command": " ".join(cmd),
        }
        if not args.json:
            print(workload.table(rows))
        print(json.dumps(report, indent=None if args.json else 2))
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
        time.sleep(0.1)


if __name__ == "__main__":
    main()
