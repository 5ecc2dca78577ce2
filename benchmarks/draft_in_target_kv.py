"""A draft model in its own KV cache against the same draft in its target's, prompts in turn.

A draft cut or quantized from its target runs in the target's cache row
(``DraftModelProposer.share_target_kv``). This measures what that changes, in one process
on one machine load: each prompt is generated plainly, then with ``--speculative draft``
with the draft keeping its own cache (the draft as it ran before: it reads the prompt itself
and feeds its own copies of the accepted drafts), then with the draft in the target's cache,
``--rounds`` times in that order. Per prompt: the end-to-end wall time of each (prefill
included: reading a prompt is the draft's cost that sharing removes), the speed-up of each
against plain, the CPU-time speed-up of the shared draft, decode steps, and per propose
the milliseconds spent and the tokens the draft read before drafting. Every speculative
answer is checked against plain greedy's tokens. Usage:

    python -m benchmarks.draft_in_target_kv TARGET DRAFT --prompts FILE [--limit 1] \
        [--rounds 2] [--new-tokens 128] [--threads 2] [--num-draft K]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from typing import Any

MODES = ("plain", "own", "shared")


def measure(
    model: Any,
    drafter: Any,
    chosen: list[Any],
    rounds: int,
    new_tokens: int,
    num_draft: int | None = None,
) -> list[dict[str, Any]]:
    """One dict per prompt (``BenchPrompt``s of ``model`` and ``drafter``, loaded models): its
    category, lengths, and per mode the wall and CPU seconds of every round, its decode
    steps, and the draft's propose time and tokens read. ``num_draft``: that many drafts
    every step (no adaptive length); None: ``generate``'s defaults."""
    from specport.runtime.speculative.draft import DraftModelProposer

    share, propose = DraftModelProposer.share_target_kv, DraftModelProposer.propose
    spent: dict[str, list[float]] = defaultdict(lambda: [0.0, 0, 0])  # seconds, calls, fed
    mode = "plain"

    def timed_propose(self: Any, context: list[list[int]], num_draft: int) -> Any:
        start = time.perf_counter()
        drafts = propose(self, context, num_draft)
        tally = spent[mode]
        tally[0] += time.perf_counter() - start
        tally[1] += 1
        tally[2] += self.caught_up
        return drafts

    def own_cache(self: Any, cache: Any, row: int) -> bool:
        return False

    out = []
    DraftModelProposer.propose = timed_propose  # type: ignore[method-assign]
    try:
        for prompt in chosen:
            row: dict[str, Any] = {"category": prompt.category, "prompt_tokens": len(prompt.ids)}
            spent.clear()
            for _ in range(rounds):
                for mode in MODES:
                    DraftModelProposer.share_target_kv = share if mode == "shared" else own_cache  # type: ignore[method-assign]
                    extra: dict[str, Any] = {}
                    if mode != "plain":
                        extra = {"speculative": "draft", "draft": drafter}
                        if num_draft is not None:
                            extra.update(num_draft=num_draft, adaptive=False)
                    wall, cpu = time.perf_counter(), time.process_time()
                    result = model.generate(
                        prompt_ids=prompt.ids, max_new_tokens=new_tokens, **extra
                    )
                    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                    if mode == "plain":
                        want = result.tokens
                    elif result.tokens != want:
                        raise AssertionError(
                            f"{mode} drafts changed the answer ({prompt.category})"
                        )
                    entry = row.setdefault(mode, {"wall": [], "cpu": []})
                    entry["wall"].append(wall)
                    entry["cpu"].append(cpu)
                    entry["steps"] = result.metrics.get("decode_steps")
            row["new_tokens"] = len(want)
            for m in ("own", "shared"):
                seconds, calls, fed = spent[m]
                row[m]["ms_per_propose"] = 1e3 * seconds / max(calls, 1)
                row[m]["read_per_propose"] = fed / max(calls, 1)
            out.append(row)
    finally:
        DraftModelProposer.share_target_kv = share  # type: ignore[method-assign]
        DraftModelProposer.propose = propose  # type: ignore[method-assign]
    return out


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table (medians over rounds)."""

    def med(row: dict[str, Any], mode: str, clock: str = "wall") -> float:
        return statistics.median(row[mode][clock])

    lines = [
        "| category | prompt tokens | new tokens | plain s | own cache s | target's cache s "
        "| own x plain | target's x plain (CPU) | steps own / target's "
        "| ms per propose own / target's | tokens read per propose own / target's |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---|---|",
    ]
    for r in rows:
        plain, own, shared = med(r, "plain"), med(r, "own"), med(r, "shared")
        cpu = med(r, "plain", "cpu") / med(r, "shared", "cpu")
        lines.append(
            f"| {r['category'] or '-'} | {r['prompt_tokens']} | {r['new_tokens']} "
            f"| {plain:.2f} | {own:.2f} | {shared:.2f} | {plain / own:.2f}x "
            f"| {plain / shared:.2f}x ({cpu:.2f}x) | {r['own']['steps']} / {r['shared']['steps']} "
            f"| {r['own']['ms_per_propose']:.1f} / {r['shared']['ms_per_propose']:.1f} "
            f"| {r['own']['read_per_propose']:.2f} / {r['shared']['read_per_propose']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target")
    parser.add_argument("draft")
    parser.add_argument("--prompts", required=True, help="a prompt file (bench --prompts formats)")
    parser.add_argument("--limit", type=int, default=1, help="records per category")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--num-draft", type=int, default=None, help="drafts per step, fixed (default: adaptive)"
    )
    args = parser.parse_args(argv)
    import specport
    from specport.bench.prompt_sets import PromptFileChoice, file_prompts, read_choice

    records, _ = read_choice(PromptFileChoice(args.prompts, limit=args.limit))
    model = specport.load(args.target, threads=args.threads)
    drafter = specport.load(args.draft, threads=args.threads)
    chosen, _ = file_prompts(model, model, records, args.new_tokens)
    rows = measure(model, drafter, chosen, args.rounds, args.new_tokens, args.num_draft)
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
