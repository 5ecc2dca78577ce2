"""The decode step's own cost per method (not a test): wall minus onnxruntime time per step.

    python -m benchmarks.step_overhead ART [--tree ART_TREE] [--mtp ART_MTP] [--eagle ART_EAGLE]
        [--auto] [--rounds 3] [--new-tokens 128] [--threads 1] [--prompt TEXT] [--json]

Per method (plain, ngram, suffix; ``auto`` with --auto; ``tree`` on a --tree-mask artifact;
``mtp`` on an MTP artifact; ``eagle`` and ``eagle-auto`` on an artifact with an EAGLE head,
whose head's runs count as onnxruntime time like the target's) it runs greedy generation ``--rounds`` times, methods interleaved within a round so
machine load hits them alike, and reports medians of decode tok/s, the speed against plain,
accepted tokens per step, ``step_overhead_ms`` (the metrics' wall minus onnxruntime time per
step) and ``host_cpu_ms``: the generating thread's CPU time outside onnxruntime per step
(``time.thread_time``; with ``--threads 1`` onnxruntime computes on that thread, so this is
robust to a loaded machine descheduling the process, which inflates the wall figure). Every
output is checked against plain greedy. Print the load average beside the figures you quote.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import specport


def count_ort_cpu(session: Any, spent: list[float]) -> None:
    """Add the calling thread's CPU time inside the session's runs to ``spent[0]``."""
    for name in ("run", "run_with_iobinding"):
        inner = getattr(session, name)

        def timed(*args: Any, _inner: Any = inner, **kwargs: Any) -> Any:
            t0 = time.thread_time()
            try:
                return _inner(*args, **kwargs)
            finally:
                spent[0] += time.thread_time() - t0

        setattr(session, name, timed)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact")
    ap.add_argument("--tree", help="a --tree-mask export of the same model (tree method)")
    ap.add_argument("--mtp", help="an MTP artifact of the same model (mtp method)")
    ap.add_argument("--eagle", help="an artifact of the same model with an EAGLE head")
    ap.add_argument("--auto", action="store_true", help="also --speculative auto on ART")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--num-draft", type=int, default=4)
    ap.add_argument(
        "--prompt",
        default="Once upon a time, there was a little girl named Lily. She loved to play",
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    base = specport.load(args.artifact, threads=args.threads)
    k = args.num_draft
    cases: list[tuple[str, Any, dict[str, Any]]] = [
        ("plain", base, {}),
        ("ngram", base, {"speculative": "ngram", "num_draft": k}),
        ("suffix", base, {"speculative": "suffix", "num_draft": k}),
    ]
    if args.auto:
        cases.append(("auto", base, {"speculative": "auto", "num_draft": k}))
    if args.eagle:
        eagle = specport.load(args.eagle, threads=args.threads)
        cases.append(("eagle", eagle, {"speculative": "eagle", "num_draft": k}))
        cases.append(("eagle-auto", eagle, {"speculative": "auto", "num_draft": k}))
    if args.tree:
        tree = specport.load(args.tree, threads=args.threads)
        cases.append(("tree", tree, {"speculative": "ngram", "num_draft": k, "tree_width": 3}))
    if args.mtp:
        mtp = specport.load(args.mtp, threads=args.threads, mtp_branch=True)
        cases.append(("mtp", mtp, {"speculative": "mtp"}))
    spent = [0.0]
    for model in {id(m): m for _, m, _ in cases}.values():
        count_ort_cpu(model.session, spent)
    for _, model, kw in cases:  # warm-up, untimed
        model.generate(args.prompt, max_new_tokens=8, ignore_eos=True, **kw)
    if args.eagle:  # the head's session opens on its first request: its runs are ORT time
        from specport.runtime.speculative import eagle as eagle_mod

        for opened in list(eagle_mod._SESSIONS.values()):
            count_ort_cpu(opened["session"], spent)

    rows: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in cases}
    for _ in range(args.rounds):
        for name, model, kw in cases:
            spent[0] = 0.0
            t0 = time.thread_time()
            out = model.generate(args.prompt, max_new_tokens=args.new_tokens, ignore_eos=True, **kw)
            m = out.metrics
            steps = m["decode_steps"] or 1
            rows[name].append(
                {
                    "tok_per_s": m["decode_tok_per_s"],
                    # computed here too, so an older checkout can be measured the same way
                    "step_overhead_ms": (m["decode_wall_s"] - m["decode_ort_s"]) / steps * 1e3,
                    "host_cpu_ms": (time.thread_time() - t0 - spent[0]) / steps * 1e3,
                    "accepted_per_step": (m.get("speculative") or {}).get("mean_accepted_length"),
                    "tokens": out.tokens,
                }
            )
    plain = rows["plain"]
    report = []
    for name, runs in rows.items():
        tps = statistics.median(r["tok_per_s"] for r in runs)
        report.append(
            {
                "method": name,
                "decode_tok_per_s": round(tps, 1),
                "vs_plain": round(tps / statistics.median(r["tok_per_s"] for r in plain), 3),
                "accepted_per_step": runs[0]["accepted_per_step"],
                "step_overhead_ms": statistics.median(r["step_overhead_ms"] for r in runs),
                "host_cpu_ms": round(statistics.median(r["host_cpu_ms"] for r in runs), 4),
                "equal_plain": all(r["tokens"] == plain[0]["tokens"] for r in runs),
            }
        )
    load = round(os.getloadavg()[0], 2)
    if args.json:
        print(json.dumps({"load_average": load, "methods": report}))
        return
    print(
        f"{args.rounds} rounds, {args.new_tokens} new tokens, threads {args.threads}, load {load}"
    )
    print("method      tok/s    vs plain  acc/step  step_overhead_ms  host_cpu_ms  equal")
    for r in report:
        acc = "-" if r["accepted_per_step"] is None else f"{r['accepted_per_step']:.2f}"
        print(
            f"{r['method']:10s} {r['decode_tok_per_s']:8.1f} {r['vs_plain']:8.2f}x {acc:>8s}"
            f" {r['step_overhead_ms']:17.3f} {r['host_cpu_ms']:12.3f}  {r['equal_plain']}"
        )


if __name__ == "__main__":
    main()
