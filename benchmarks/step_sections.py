"""Where a decode step's host time goes: CPU time outside onnxruntime per function, per step.

    python -m benchmarks.step_sections ART --method ngram [--calls 6] [--new-tokens 64]

Runs greedy ``generate`` at batch 1 (``--method`` plain, ngram, suffix or eagle; eagle needs
an artifact with an EAGLE head) ``--calls`` times with the step's functions wrapped: each
wrapper adds the generating thread's CPU time inside the function (``time.thread_time``)
minus the time inside the sessions' runs (the target's and the EAGLE head's) to that
function's total. Times are inclusive (``step.run`` contains ``SharedKVCache.step_row``,
which contains ``BoundSession.extend``...), and each wrapper costs about 1 us, so the total
reads a little above ``benchmarks.step_overhead``'s ``host_cpu_ms``; use it to see where the
time goes, that one for the figure. Host work between runs is slow (caches cold from the
weight stream), so a function's time here is often several times its time in a loop on its
own. Quote the load average beside the figures.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import os
import time
from typing import Any

import specport
from benchmarks.step_overhead import count_ort_cpu

# (module, attribute path): the step's layers and what each method adds
SECTIONS = [
    ("specport.runtime.engine.step", "propose"),
    ("specport.runtime.engine.step", "run"),
    ("specport.runtime.engine.step", "_decode"),
    ("specport.runtime.kv.cache", "SharedKVCache.step_row"),
    ("specport.runtime.kv.cache", "SharedKVCache.keep"),
    ("specport.runtime.kv.iobinding", "BoundSession.extend"),
    ("specport.runtime.kv.iobinding", "BoundSession.decode"),
    ("specport.runtime.kv.iobinding", "BoundSession._run"),
    ("specport.runtime.speculative.verify", "GreedyVerifier.chain"),
    ("specport.runtime.speculative.metrics", "AdaptiveDraftLength.choose"),
    ("specport.runtime.speculative.metrics", "AdaptiveDraftLength.observe"),
    ("specport.runtime.speculative.metrics", "SpecDecodingStats.observe_draft"),
]
BY_METHOD = {
    "ngram": [
        ("specport.runtime.speculative.base", "RowProposer.propose"),
        ("specport.runtime.speculative.ngram", "NgramProposer.propose_one"),
        ("specport.runtime.speculative.ngram", "SuffixLookup.find"),
    ],
    "suffix": [
        ("specport.runtime.speculative.base", "RowProposer.propose"),
        ("specport.runtime.speculative.suffix", "SuffixProposer.propose_one"),
        ("specport.runtime.speculative.ngram", "SuffixLookup.find"),
        ("specport.runtime.speculative.suffix", "SuffixIndex.longest_match"),
        ("specport.runtime.speculative.suffix", "SuffixIndex.continuation"),
    ],
    "eagle": [
        ("specport.runtime.speculative.eagle", "EagleProposer.propose"),
        ("specport.runtime.speculative.eagle", "EagleProposer._advance"),
        ("specport.runtime.speculative.eagle", "EagleProposer._run"),
        ("specport.runtime.speculative.eagle", "EagleProposer.observe"),
    ],
}


def wrap(module: str, path: str, spent: list[float], total: Any, calls: Any) -> None:
    """Replace ``module.path`` with a wrapper that adds its CPU time outside the runs."""
    owner: Any = importlib.import_module(module)
    *parents, name = path.split(".")
    for part in parents:
        owner = getattr(owner, part)
    inner = getattr(owner, name)
    key = f"{module.rsplit('.', 1)[-1]}.{path}"

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0, s0 = time.thread_time(), spent[0]
        try:
            return inner(*args, **kwargs)
        finally:
            total[key] += time.thread_time() - t0 - (spent[0] - s0)
            calls[key] += 1

    setattr(owner, name, timed)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact")
    ap.add_argument("--method", default="ngram", choices=["plain", "ngram", "suffix", "eagle"])
    ap.add_argument("--calls", type=int, default=6)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument(
        "--prompt",
        default="Once upon a time, there was a little girl named Lily. She loved to play",
    )
    args = ap.parse_args(argv)
    model = specport.load(args.artifact, threads=1)
    kw = {} if args.method == "plain" else {"speculative": args.method}
    spent = [0.0]
    count_ort_cpu(model.session, spent)
    model.generate(args.prompt, max_new_tokens=8, ignore_eos=True, **kw)  # warm-up
    if args.method == "eagle":  # the head's session opened in the warm-up
        from specport.runtime.speculative import eagle

        for opened in list(eagle._SESSIONS.values()):
            count_ort_cpu(opened["session"], spent)
    total: collections.Counter[str] = collections.Counter()
    calls: collections.Counter[str] = collections.Counter()
    for module, path in SECTIONS + BY_METHOD.get(args.method, []):
        wrap(module, path, spent, total, calls)
    steps, host = 0, 0.0
    load = [os.getloadavg()[0]]
    for _ in range(args.calls):
        spent[0] = 0.0
        t0 = time.thread_time()
        out = model.generate(args.prompt, max_new_tokens=args.new_tokens, ignore_eos=True, **kw)
        host += time.thread_time() - t0 - spent[0]
        steps += out.metrics["decode_steps"]
    load.append(os.getloadavg()[0])
    print(
        f"{args.method}: {args.calls} calls, {steps / args.calls:.1f} steps each, host CPU "
        f"{host / steps * 1e3:.3f} ms per step (wrapped), load {load[0]:.1f} -> {load[1]:.1f}"
    )
    print(" ms/step  calls/step  us/call  function (inclusive)")
    for key, seconds in sorted(total.items(), key=lambda kv: -kv[1]):
        print(
            f"{seconds / steps * 1e3:8.4f} {calls[key] / steps:10.2f} "
            f"{seconds / calls[key] * 1e6:8.1f}  {key}"
        )


if __name__ == "__main__":
    main()
