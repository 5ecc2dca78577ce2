"""Running streams' token gaps while a long prompt prefills (not a test).

    python -m benchmarks.long_prompt_stall ART [--prompt-tokens 2500] [--streams 4]
        [--rounds 3] [--threads 2] [--stall 4] [--json]
    python -m benchmarks.long_prompt_stall MODEL --url http://127.0.0.1:8000 [--rounds 3]

Per round, for each setting (the fixed chunk of earlier releases: ``prefill_stall=None``, 256
tokens a prompt, 512 a round; then ``prefill_stall=S`` for each ``--stall``), interleaved so
machine load hits them alike: a fresh batching engine starts ``--streams`` greedy requests
(short prompts, ``ignore_eos``), lets them decode ``--warm`` tokens, then submits one unique
prompt of ``--prompt-tokens`` random token ids (no prefix-cache hit). Reported per setting,
medians over rounds: the streams' usual gap (their median gap before the long prompt came),
their worst gap and their median gap between its arrival and its first token, the worst
stream's ratio of worst to usual gap, and the long prompt's time to first token. (A median
over the whole run would count the stretched gaps of the prefill as usual.) Quote the load
average (printed) and the CPU flags.

With ``--url`` the same run goes to a running OpenAI-compatible server (``specport serve``,
llama.cpp's ``llama-server``) over streamed completions, at that server's own settings, one run
per round; each stream's token events are timed as they arrive, so HTTP and the server's event
batching are part of every gap.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from typing import Any

import numpy as np

import specport
from specport.runtime.engine.base import Request
from specport.runtime.engine.batching import BatchingEngine


class _Times:
    """Arrival times of a handle's token events (recorded on the engine's thread)."""

    def __init__(self, handle: Any) -> None:
        self.handle, self.times, self.tokens = handle, [], 0
        self.lock = threading.Lock()
        handle.add_listener(self.wake)

    def wake(self) -> None:
        now = time.perf_counter()
        with self.lock:
            for ev in self.handle.take():
                if ev.token_ids:
                    self.times.append(now)
                    self.tokens += len(ev.token_ids)


def one(model: Any, stall: float | None, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    engine = BatchingEngine(
        model, max_batch=args.streams + 1, max_length=args.prompt_tokens + 1024,
        prefill_stall=stall,
    )  # fmt: skip
    try:
        rng = np.random.default_rng(seed)
        vocab = model.manifest.vocab_size
        streams = []
        for i in range(args.streams):
            ids = model.encode(f"Story {i}: once upon a time, in a town by the sea,")
            req = Request(ids, max_new_tokens=1000, ignore_eos=True, request_id=f"s{i}")
            streams.append(_Times(engine.submit(req)))
        while min(s.tokens for s in streams) < args.warm:
            time.sleep(0.01)
        long_ids = rng.integers(100, vocab, args.prompt_tokens).tolist()
        t_arrive = time.perf_counter()
        long = _Times(engine.submit(Request(long_ids, max_new_tokens=4, request_id="long")))
        while not long.times:
            time.sleep(0.005)
        t_first = long.times[0]
        time.sleep(0.5)  # a few more stream tokens after it
        for st in streams:
            st.handle.cancel()
        times = []
        for st in streams:
            with st.lock:
                times.append(np.asarray(st.times))
        out = gap_report(times, t_arrive, t_first)
        return {**out, "prefill_runs": engine.stats()["prefill_runs"]}
    finally:
        engine.close()


def gap_report(times: list[np.ndarray], t_arrive: float, t_first: float) -> dict[str, float]:
    """The streams' gaps around a long prompt: ``times`` per stream (its tokens' arrival
    times), the long prompt's arrival and its first token's time."""
    ratios, worsts, usual, during = [], [], [], []
    for t in times:
        gaps = np.diff(t)
        before = gaps[4:][t[5:] < t_arrive]  # the first few steps admit the others
        inside = (t[1:] > t_arrive) & (t[:-1] < t_first + 0.05)
        worst = float(gaps[inside].max()) if inside.any() else float("nan")
        ratios.append(worst / float(np.median(before)))
        worsts.append(worst)
        usual.append(float(np.median(before)))
        during.append(float(np.median(gaps[inside])) if inside.any() else float("nan"))
    return {
        "ratio": max(ratios),
        "worst_gap_ms": 1000 * max(worsts),
        "usual_gap_ms": 1000 * statistics.median(usual),
        "gap_during_ms": 1000 * statistics.median(during),
        "ttft_s": t_first - t_arrive,
    }


def _sse_times(url: str, body: dict[str, Any], times: list[float], stop: threading.Event) -> None:
    """Stream one completion, appending each token event's arrival time to ``times``."""
    import httpx

    with httpx.Client(timeout=600) as c, c.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if stop.is_set() or line == "data: [DONE]":
                return
            if line.startswith("data: ") and json.loads(line[6:]).get("choices"):
                times.append(time.perf_counter())


def one_http(url: str, model: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """The same run against a server over HTTP (any OpenAI-compatible one: specport serve,
    llama.cpp's llama-server): streamed completions, token events timed on arrival; the long
    prompt is sent as token ids (random, in [100, 49152): no prefix-cache hit)."""
    stop = threading.Event()
    times: list[list[float]] = [[] for _ in range(args.streams)]
    base = {"model": model, "temperature": 0, "ignore_eos": True, "stream": True}
    story = "Story {}: once upon a time, in a town by the sea,"
    bodies = [{**base, "prompt": story.format(i), "max_tokens": 2000} for i in range(args.streams)]
    threads = [
        threading.Thread(target=_sse_times, args=(url, b, t, stop), daemon=True)
        for b, t in zip(bodies, times)
    ]
    for t in threads:
        t.start()
    while min(len(t) for t in times) < args.warm:
        time.sleep(0.01)
    ids = np.random.default_rng(seed).integers(100, args.vocab, args.prompt_tokens).tolist()
    long: list[float] = []
    t_arrive = time.perf_counter()
    body = {**base, "prompt": ids, "max_tokens": 4}
    done = threading.Thread(target=_sse_times, args=(url, body, long, threading.Event()))
    done.start()
    while not long:
        time.sleep(0.005)
    t_first = long[0]
    time.sleep(0.5)
    stop.set()
    report = gap_report([np.asarray(t) for t in times], t_arrive, t_first)
    done.join(timeout=60)
    for t in threads:
        t.join(timeout=60)  # ends at the stream's next event
    return report


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact", help="an artifact (in-process engines), or with --url a name")
    ap.add_argument("--url", help="measure this running server over HTTP instead (its settings)")
    ap.add_argument("--vocab", type=int, default=49152, help="--url: the long prompt's id range")
    ap.add_argument("--prompt-tokens", type=int, default=2500)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--warm", type=int, default=30, help="stream tokens before the long prompt")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--stall", type=float, action="append", help="prefill_stall to try (4)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.url:
        outs = []
        for r in range(args.rounds):
            outs.append(one_http(args.url, args.artifact, args, seed=1000 * r))
            print(f"round {r}: " + json.dumps({k: round(v, 3) for k, v in outs[-1].items()}))
        summary = {k: round(statistics.median(o[k] for o in outs), 3) for k in outs[0]}
        report = {"summary": summary, "load_average": os.getloadavg(), "args": vars(args)}
        print(json.dumps(report, indent=None if args.json else 2))
        return
    model = specport.load(args.artifact, threads=args.threads)
    settings: list[float | None] = [None, *(args.stall or [4.0])]
    runs: dict[str, list[dict[str, Any]]] = {str(s): [] for s in settings}
    for r in range(args.rounds):
        for s in settings:
            out = one(model, s, args, seed=1000 * r + len(runs[str(s)]))
            runs[str(s)].append(out)
            print(f"round {r} stall={s}: " + json.dumps({k: round(v, 3) for k, v in out.items()}))
    summary = {
        s: {k: round(statistics.median(o[k] for o in outs), 3) for k in outs[0]}
        for s, outs in runs.items()
    }
    report = {"summary": summary, "load_average": os.getloadavg(), "args": vars(args)}
    print(json.dumps(report, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
