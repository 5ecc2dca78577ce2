"""Plain greedy decoding on the shared layout: ``bound_loop.run_bound`` vs the one step's driver.

    python -m benchmarks.plain_paths ART [--rounds 5] [--new-tokens 128] [--batch 1]

Why both exist: plain decoding could be the one step with no proposer
(``engine.driver.generate_rows(..., make_proposer=None)``), but the step's per-token
bookkeeping (a ``StepRow`` per row, the KV interface's length arrays, a ``VerifyResult``) costs
host time between onnxruntime runs, where caches are cold from the weight stream. This measures
it: the generating thread's CPU time outside onnxruntime per new token (``time.thread_time``;
with ``--threads 1`` onnxruntime computes on that thread, so the figure is robust to a loaded
machine), both paths interleaved round by round in one process, outputs checked equal. Quote
the load average beside the figures.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import specport
from benchmarks.step_overhead import count_ort_cpu
from specport.runtime.engine.driver import generate_rows
from specport.runtime.generator import Generator


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument(
        "--prompt",
        default="Once upon a time, there was a little girl named Lily. She loved to play",
    )
    args = ap.parse_args(argv)
    model = specport.load(args.artifact, threads=1)
    spent = [0.0]
    count_ort_cpu(model.session, spent)
    prompts = [model.encode(args.prompt)] * args.batch
    gen = Generator(model.session, model.manifest)
    # Both keep their KV buffers, and at batch 1 the ids those hold, between calls, as a loaded
    # model keeps them for the next call (`Model.plain_generator`, `Model.speculative_slot`):
    # neither pays for allocating its cache or for prefilling a prompt it has seen.
    kept: dict[str, Any] = {"cache": None, "held": None}

    def driver() -> list[list[int]]:
        out = generate_rows(
            model, prompts, args.new_tokens, None, 0, cache=kept["cache"], held=kept["held"]
        )
        kept["cache"], kept["held"] = out.cache, out.held
        return out.tokens

    paths = {
        "bound_loop": lambda: gen.generate(prompts, args.new_tokens).tokens,
        "driver": driver,
    }
    want = paths["bound_loop"]()  # each path's first call (its buffers) is a warm-up
    if paths["driver"]() != want:
        raise SystemExit("driver: output differs from run_bound's")
    host: dict[str, list[float]] = {name: [] for name in paths}
    speed: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(args.rounds):
        for name, run in paths.items():
            spent[0] = 0.0
            c0, w0 = time.thread_time(), time.perf_counter()
            got = run()
            c1, w1 = time.thread_time(), time.perf_counter()
            if got != want:
                raise SystemExit(f"{name}: output differs from run_bound's")
            n = sum(len(t) for t in got)
            host[name].append((c1 - c0 - spent[0]) / n * 1e6)
            speed[name].append(n / (w1 - w0))
    for name in paths:
        print(
            f"{name:<11} host CPU per token {statistics.median(host[name]):7.1f} us "
            f"(rounds {[round(x) for x in host[name]]}), {statistics.median(speed[name]):.2f} tok/s"
        )
    ratios = [d / b for d, b in zip(speed["driver"], speed["bound_loop"])]
    print(
        f"driver / bound_loop tok/s: {statistics.median(ratios):.3f} "
        f"(median of per-round ratios {[round(r, 3) for r in ratios]})"
    )


if __name__ == "__main__":
    main()
