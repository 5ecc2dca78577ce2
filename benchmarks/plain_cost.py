"""Plain greedy decoding of two artifacts of one model, interleaved: what a graph change costs.

    python -m benchmarks.plain_cost BASE CHANGED [--rounds 9] [--new-tokens 64] [--prompt-len 32]

Each round decodes the same prompt with both artifacts (the order alternating per round) and
records, per new token, the generating thread's CPU time (``time.thread_time``: with
``--threads 1`` onnxruntime computes on that thread, so the figure holds up on a loaded
machine) and the wall time per output token. Figures are medians over rounds; the ratio is the
median of per-round ratios (> 1: CHANGED is slower). Outputs are checked equal when both
artifacts should give the same tokens (``--same-tokens``). Quote the load average beside them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

import specport


def decode(model: object, prompt: list[int], new: int) -> tuple[float, float, list[int]]:
    """(CPU ms per decode token, wall TPOT ms, tokens) of one plain greedy call."""
    cpu0 = time.thread_time()
    out = model.generate(prompt_ids=prompt, max_new_tokens=new, ignore_eos=True)  # type: ignore[attr-defined]
    cpu = (time.thread_time() - cpu0) * 1e3 / max(new, 1)
    return cpu, float(out.metrics["tpot_ms"]), list(out.tokens)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("base")
    ap.add_argument("changed")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--same-tokens", action="store_true")
    args = ap.parse_args(argv)
    models = {
        name: specport.load(path, threads=args.threads)
        for name, path in (("base", args.base), ("changed", args.changed))
    }
    vocab = int(models["base"].manifest.config.get("vocab_size", 256))  # type: ignore[attr-defined]
    prompt = [int(x) for x in np.random.default_rng(0).integers(3, vocab, args.prompt_len)]
    for m in models.values():
        decode(m, prompt, 4)  # warm-up
    cpu: dict[str, list[float]] = {k: [] for k in models}
    wall: dict[str, list[float]] = {k: [] for k in models}
    ratios_cpu, ratios_wall = [], []
    print("load average", os.getloadavg())
    for r in range(args.rounds):
        order = list(models) if r % 2 == 0 else list(reversed(models))
        got = {}
        for name in order:
            c, w, toks = decode(models[name], prompt, args.new_tokens)
            cpu[name].append(c)
            wall[name].append(w)
            got[name] = toks
        if args.same_tokens and got["base"] != got["changed"]:
            raise SystemExit("the two artifacts gave different tokens")
        ratios_cpu.append(cpu["changed"][-1] / cpu["base"][-1])
        ratios_wall.append(wall["changed"][-1] / wall["base"][-1])
    for name in models:
        print(
            f"{name:<8} CPU ms/token {statistics.median(cpu[name]):.2f} (min {min(cpu[name]):.2f})"
            f"  TPOT ms {statistics.median(wall[name]):.2f} (min {min(wall[name]):.2f})"
        )
    print(
        f"changed / base: CPU per token {statistics.median(ratios_cpu):.3f}x, "
        f"TPOT {statistics.median(ratios_wall):.3f}x (medians of {args.rounds} per-round ratios)"
    )
    print("load average", os.getloadavg())


if __name__ == "__main__":
    main()
