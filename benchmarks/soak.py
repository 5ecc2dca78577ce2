"""Soak test: many concurrent streams for minutes against one OpenAI-compatible server.

    python -m benchmarks.soak http://127.0.0.1:8000 --model NAME \
        --concurrency 64 --minutes 10 --max-tokens 32

Takes each seeded prompt's greedy answer alone first (the reference), then keeps `concurrency`
streams busy until the time is up, each request checked against its own prompt's reference.
Reports what a soak must show: requests done, errors, lost or mixed-up answers (mismatches),
the server's resident memory over the run (`process_resident_memory_bytes` from `/metrics`,
sampled every `--sample` seconds: growth beyond the warm-up is a leak), and whether the
server's own finished-request counter moved by exactly the number of requests the client saw.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
import time
from typing import Any

import httpx

from specport.bench.loadtest import client_for, one, prompts, references

logger = logging.getLogger(__name__)

_RSS = re.compile(r"^process_resident_memory_bytes (\S+)$", re.M)
_DONE = re.compile(r"^vllm:request_success_total\{[^}]*\} (\S+)$", re.M)


def scrape(url: str, api_key: str) -> tuple[float | None, float]:
    """(resident bytes or None when the server does not export it, finished requests)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    text = httpx.get(url.rstrip("/") + "/metrics", headers=headers, timeout=30).text
    rss = _RSS.search(text)
    return (float(rss.group(1)) if rss else None), sum(float(v) for v in _DONE.findall(text))


async def soak(
    url: str, model: str, concurrency: int, seconds: float, max_tokens: int, api_key: str,
    sample_s: float = 30.0, distinct: int = 64,
) -> dict[str, Any]:  # fmt: skip
    client = client_for(url, api_key or "unused")  # the client insists on some key
    texts = prompts(distinct, seed=1)
    refs = await references(client, model, texts, max_tokens)
    rss0, done0 = await asyncio.to_thread(scrape, url, api_key)
    counts = {"requests": 0, "errors": 0, "mismatches": 0, "tokens": 0}
    samples: list[tuple[float, float | None]] = [(0.0, rss0)]
    t0 = time.perf_counter()
    deadline = t0 + seconds

    async def worker(k: int) -> None:
        i = k
        while time.perf_counter() < deadline:
            p = texts[i % len(texts)]
            r = await one(client, model, p, max_tokens)
            counts["requests"] += 1
            counts["tokens"] += r.tokens
            counts["errors"] += r.error is not None
            counts["mismatches"] += r.error is None and r.text != refs[p]
            i += concurrency

    async def sampler() -> None:
        while time.perf_counter() < deadline:
            await asyncio.sleep(min(sample_s, max(0.0, deadline - time.perf_counter())))
            rss, _ = await asyncio.to_thread(scrape, url, api_key)
            samples.append((round(time.perf_counter() - t0, 1), rss))
            logger.info("t=%.0fs requests=%d errors=%d rss=%s", samples[-1][0],
                        counts["requests"], counts["errors"], rss)  # fmt: skip

    await asyncio.gather(sampler(), *(worker(k) for k in range(concurrency)))
    wall = time.perf_counter() - t0
    await client.close()
    rss1, done1 = await asyncio.to_thread(scrape, url, api_key)
    known = [m for _, m in samples if m is not None]
    warm = known[len(known) // 4 :] or known  # the first quarter is warm-up (pools, arenas)
    return {
        "concurrency": concurrency,
        "seconds": round(wall, 1),
        **counts,
        "output_tokens_per_s": round(counts["tokens"] / wall, 1),
        "rss_mb": {
            "start": _mb(rss0),
            "after_warmup": _mb(warm[0] if warm else None),
            "max": _mb(max(known) if known else None),
            "end": _mb(rss1),
        },
        "server_finished_requests": int(done1 - done0),
        "client_requests": counts["requests"],
        "metrics_agree": int(done1 - done0) == counts["requests"],
        "rss_samples": samples,
    }


def _mb(value: float | None) -> float | None:
    return None if value is None else round(value / 2**20, 1)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("url", help="the server's base URL (http://host:port)")
    p.add_argument("--model", required=True, help="the model name the server expects")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--sample", type=float, default=30.0, help="seconds between memory samples")
    p.add_argument("--api-key", default="")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for name in ("httpx", "httpx2"):  # the openai client logs a line per request
        logging.getLogger(name).setLevel(logging.WARNING)
    report = asyncio.run(
        soak(args.url, args.model, args.concurrency, args.minutes * 60, args.max_tokens,
             args.api_key, args.sample)
    )  # fmt: skip
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
