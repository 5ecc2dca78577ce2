"""The verify costs `--speculative auto` corrects while decoding, by CPU time and by wall time, from
the same steps.

auto times each step (from one propose to the next: verify run and host work) and corrects its
verify-cost table from those times (`runtime/engine/step_cost.py`, `LiveVerifyCosts`). It
times them in process CPU time; this decodes a prompt file's first turns with auto (greedy) and
feeds a second tracker the wall time of the very same steps, then prints both corrected
tables (verifying k drafts, in plain steps) and the load average. On an idle machine the two
agree; on an oversubscribed one the wall-time table prices drafts higher, by the waits for a
core. A third tracker gets the CPU times without their contexts, so it prices every verify
step against all plain steps (the rule before steps were compared at their own context), and
the mean context of each draft count's steps is printed beside it. Usage:

    python benchmarks/verify_cost_live.py ARTIFACT --prompts FILE [--category NAME ...]
        [--limit 2] [--threads 2] [--new-tokens 128]
"""

from __future__ import annotations

import argparse
import os
import time

import specport
from specport.core.chat_template import load_chat_template
from specport.core.prompt_files import read_prompt_file, select
from specport.runtime.engine.step_cost import LIVE_MIN, LiveVerifyCosts, live_verify_costs

SHOWN = (1, 2, 4, 8)  # draft counts printed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifact")
    p.add_argument("--prompts", required=True)
    p.add_argument("--category", action="append", default=[])
    p.add_argument("--limit", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=128)
    args = p.parse_args()
    model = specport.load(args.artifact, threads=args.threads)
    template = load_chat_template(model)
    records = [
        r
        for r in select(read_prompt_file(args.prompts).records, args.limit)
        if not args.category or r.category in args.category
    ]
    live = live_verify_costs(model)  # what auto reads and corrects (its clock: CPU time)
    wall = LiveVerifyCosts(live.table, None, time.perf_counter)  # the same steps, wall time
    anywhere = LiveVerifyCosts(live.table, None, live.clock)  # the same, contexts left out
    contexts: dict[int, list[int]] = {}
    stamps: list[float] = []
    cpu_clock = live.clock

    def clock() -> float:  # auto's clock, stamping the wall time at the same instants
        stamps.append(time.perf_counter())
        return cpu_clock()

    observe = live.observe

    def both(drafts: int, seconds: float, context: int = 0) -> bool:  # between two stamps
        wall.observe(drafts, stamps[-1] - stamps[-2], context)
        anywhere.observe(drafts, seconds)
        contexts.setdefault(drafts, []).append(context)
        return observe(drafts, seconds, context)

    live.clock, live.observe = clock, both  # type: ignore[method-assign]
    load0 = os.getloadavg()
    for record in records:
        text = record.messages() if record.chat and template else record.text()
        ids = template.render_ids(text) if isinstance(text, list) else model.encode(text)
        model.generate(prompt_ids=ids, max_new_tokens=args.new_tokens, speculative="auto")
    load1 = os.getloadavg()
    print(f"{len(records)} prompts, {live.steps} timed steps (a count corrects after {LIVE_MIN})")
    print(
        f"load average (1, 5, 15 min) {load0[0]:.1f} {load0[1]:.1f} {load0[2]:.1f} -> "
        f"{load1[0]:.1f} {load1[1]:.1f} {load1[2]:.1f} on {os.cpu_count()} cores"
    )
    trackers = (
        ("measured at start", None),
        ("cpu time", live),
        ("any context", anywhere),
        ("wall time", wall),
    )
    for name, tracker in trackers:
        costs = live.table if tracker is None else tracker.costs
        cells = ", ".join(f"{k}: {costs[k]:.2f}" for k in SHOWN if k < len(costs))
        print(f"{name:>17}: {cells}")
    steps = ", ".join(
        f"{k}: {len(c)} at {sum(c) / len(c):.0f}" for k, c in sorted(contexts.items())
    )
    print(f"steps per draft count at their mean context: {steps}")


if __name__ == "__main__":
    main()
