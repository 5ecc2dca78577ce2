"""What bounds a draft model's speed-up: how often it agrees with the target, and what a draft
run costs against a target step, per task of a prompt file.

For each prompt the target decodes its plain greedy answer; each draft then reads prompt and
answer teacher-forced (one run) and its argmax at every answer position is compared with the
target's token. A draft chain accepted so far is exactly this teacher-forced context, so the
agreement ``p`` is the per-position acceptance of greedy draft-model speculation. Each
artifact's one-token step (and the target's verify runs of 2-9 tokens) is timed at a context of
``--context`` tokens, the artifacts alternating in every round. The bound for a draft alone,
K drafts per step, position-independent acceptance ``p``, a draft run costing ``d`` target
steps and a verify of K drafts ``v(K)``:

    speed-up <= max over K of (1 + p + ... + p^K) / (v(K) + d K)

(host work and the misses' correlation only lower it). Usage:

    python -m benchmarks.draft_ceiling TARGET DRAFT [DRAFT ...] --prompts FILE \\
        [--prompts-limit 2] [--context 300 800] [--rounds 15]
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from typing import Any

import numpy as np

import specport
from specport.bench.prompt_sets import BenchPrompt, PromptFileChoice, file_prompts, read_choice
from specport.core.errors import SpecportError
from specport.runtime.kv.seq_cache import open_cache

WIDTHS = (1, 2, 3, 5, 9)  # tokens per run: one-token steps and verifies of 1, 2, 4, 8 drafts


def greedy_answers(target: Any, prompts: list[BenchPrompt]) -> list[tuple[BenchPrompt, list[int]]]:
    """Each prompt with the target's plain greedy answer (128 new tokens)."""
    return [
        (bp, list(target.generate(prompt_ids=bp.ids, max_new_tokens=128).tokens)) for bp in prompts
    ]


def agreement(
    drafts: list[Any], answers: list[tuple[BenchPrompt, list[int]]]
) -> dict[str, dict[str, float]]:
    """Per draft and task: the share of the target's greedy answer tokens each draft's argmax
    gives, teacher-forced."""
    hits: dict[str, dict[str, list[int]]] = {
        d.path.name: defaultdict(lambda: [0, 0]) for d in drafts
    }
    for bp, answer in answers:
        seq = list(bp.ids) + answer
        for draft in drafts:
            cache = open_cache(draft.session, draft.manifest)
            logits = np.asarray(cache.step(seq[:-1], last_only=False).logits)
            guess = logits.reshape(-1, logits.shape[-1])[len(bp.ids) - 1 :].argmax(-1)
            tally = hits[draft.path.name][bp.category or "all"]
            tally[0] += int((guess == np.asarray(answer)).sum())
            tally[1] += len(answer)
    out: dict[str, dict[str, float]] = {}
    for name, per in hits.items():
        out[name] = {cat: ok / n for cat, (ok, n) in per.items()}
        out[name]["all"] = sum(ok for ok, _ in per.values()) / sum(n for _, n in per.values())
    return out


def step_costs(models: list[Any], context: int, rounds: int) -> dict[str, dict[int, float]]:
    """Median ms of a run of w tokens after `context` tokens, per artifact and width."""
    caches = {}
    rng = np.random.default_rng(0)
    for m in models:
        cache = open_cache(m.session, m.manifest)
        cache.step(list(rng.integers(100, 8000, context)), last_only=True)
        caches[m.path.name] = cache
    times: dict[str, dict[int, list[float]]] = {n: defaultdict(list) for n in caches}
    for _ in range(rounds):
        for name, cache in caches.items():
            for w in WIDTHS:
                t0 = time.perf_counter()
                for _ in range(4):
                    cache.step([123] * w, last_only=w == 1)
                    cache.keep(context)
                times[name][w].append((time.perf_counter() - t0) / 4 * 1000)
    return {n: {w: float(np.median(t)) for w, t in per.items()} for n, per in times.items()}


def bound(p: float, d: float, verify: dict[int, float]) -> tuple[int, float]:
    """(best K, speed-up bound) for acceptance p, draft cost d (target steps) and verify costs
    at the measured widths (K = width - 1)."""
    best = (0, 1.0)
    for w, v in verify.items():
        k = w - 1
        if k < 1:
            continue
        tokens = 1.0 + sum(p**i for i in range(1, k + 1))
        value = tokens / (v + d * k)
        if value > best[1]:
            best = (k, value)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("target")
    ap.add_argument("drafts", nargs="+")
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--prompts-limit", type=int, default=2)
    ap.add_argument("--context", type=int, nargs="+", default=[300, 800])
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    try:
        target = specport.load(args.target)
        drafts = [specport.load(d) for d in args.drafts]
        records, _ = read_choice(PromptFileChoice(args.prompts, limit=args.prompts_limit))
    except SpecportError as e:
        ap.error(str(e))
    prompts, _ = file_prompts(target, target, records, 128)
    agree = agreement(drafts, greedy_answers(target, prompts))
    cats = [*sorted({c for per in agree.values() for c in per if c != "all"}), "all"]
    print("teacher-forced agreement with the target's greedy answers (draft-alone acceptance)")
    print("draft".ljust(16) + "".join(c[:14].rjust(15) for c in cats))
    for name, per in agree.items():
        print(name.ljust(16) + "".join(f"{per.get(c, float('nan')):15.3f}" for c in cats))
    for context in args.context:
        costs = step_costs([target, *drafts], context, args.rounds)
        base = costs[target.path.name][1]
        verify = {w: ms / base for w, ms in costs[target.path.name].items()}
        print(f"\ncontext {context}: ms per run of 1/2/3/5/9 tokens (ratio to the target's step)")
        for name, per in costs.items():
            cells = "  ".join(f"{per[w]:.2f} ({per[w] / base:.2f})" for w in WIDTHS)
            print(f"  {name.ljust(14)} {cells}")
        for draft in drafts:
            name = draft.path.name
            d = costs[name][1] / base
            k, value = bound(agree[name]["all"], d, verify)
            print(f"  {name}: draft run {d:.2f} of a target step; bound {value:.2f}x at K = {k}")


if __name__ == "__main__":
    main()
