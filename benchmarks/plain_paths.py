"""Plain decoding's host cost: the one step with no proposer, per new token, at several batches.

    python -m benchmarks.plain_paths ART [--rounds 5] [--new-tokens 64] [--batches 1 4 16]

Plain decoding is the engine's one step with no proposer (``runtime.generator.Generator`` over
``engine.driver.generate_rows``); what it costs beyond onnxruntime is host work between runs,
where caches are cold from the weight stream. Per batch this reports the generating thread's
CPU time outside onnxruntime per new token (``time.thread_time``; with one onnxruntime thread
it computes on that thread, so the figure holds up on a loaded machine) and the wall decode
speed, batches interleaved round by round in one process, every round's tokens checked equal
to the first round's. As a loaded model does, each batch keeps its KV buffers between calls
and, at batch 1, the ids they hold (a repeated prompt is not prefilled again); each batch's
first call is a warm-up. Quote the load average beside the figures.

Until commit 7869009 this compared the former plain loop (``bound_loop.run_bound``) with the
step; run that commit's version for the figures that retired it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import specport
from benchmarks.step_overhead import count_ort_cpu
from specport.runtime.generator import Generator


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument(
        "--prompt",
        default="Once upon a time, there was a little girl named Lily. She loved to play",
    )
    args = ap.parse_args(argv)
    model = specport.load(args.artifact, threads=1)
    spent = [0.0]
    count_ort_cpu(model.session, spent)
    prompt = model.encode(args.prompt)
    gens = {b: Generator(model.session, model.manifest) for b in args.batches}
    want = {b: gens[b].generate([prompt] * b, args.new_tokens).tokens for b in args.batches}
    host: dict[int, list[float]] = {b: [] for b in args.batches}
    speed: dict[int, list[float]] = {b: [] for b in args.batches}
    load = [os.getloadavg()[0]]
    for _ in range(args.rounds):
        for b in args.batches:
            spent[0] = 0.0
            c0, w0 = time.thread_time(), time.perf_counter()
            got = gens[b].generate([prompt] * b, args.new_tokens)
            c1, w1 = time.thread_time(), time.perf_counter()
            if got.tokens != want[b]:
                raise SystemExit(f"batch {b}: output differs from its first round's")
            n = sum(len(t) for t in got.tokens)
            host[b].append((c1 - c0 - spent[0]) / n * 1e6)
            speed[b].append(n / (w1 - w0))
    load.append(os.getloadavg()[0])
    print(
        f"{args.rounds} rounds, {args.new_tokens} new tokens, load {load[0]:.1f} -> {load[1]:.1f}"
    )
    for b in args.batches:
        print(
            f"batch {b:<3} host CPU per token {statistics.median(host[b]):7.1f} us "
            f"(rounds {[round(x) for x in host[b]]}), {statistics.median(speed[b]):.2f} tok/s"
        )


if __name__ == "__main__":
    main()
