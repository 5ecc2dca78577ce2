"""The synchronous driver of the one step: several prompts (or one) decoded to the end, in order.

``generate_rows`` is what ``Model.generate_batch(speculative=...)`` runs on a shared-layout
artifact: every prompt gets a row of one ``SharedKVCache``, is prefilled on its own view
(without its last token, which the first step feeds with the first drafts), and then every
live row takes part in each ``engine.step`` — propose, one run over every row's ``[last,
drafts]``, verify, commit — until it stops (EOS, a stop string, its token budget). Rows that
drafted nothing decode in that same run; where the graph cannot take several new tokens per
row at batch > 1 (artifacts exported before ``query_seqlens``, see ``takes_batched_steps``)
rows with drafts verify one by one at batch 1 and the others decode together, as in the
serving engine. One prompt is a batch of one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from specport.runtime.engine import step
from specport.runtime.kv.cache import SharedKVCache, takes_batched_steps
from specport.runtime.kv.seq_cache import context_limit
from specport.runtime.sampler import Sampler, SamplingConfig
from specport.runtime.speculative.base import Drafts, Proposer, check_prompts, stop_reason
from specport.runtime.speculative.metrics import (
    AdaptiveDraftLength,
    SpecDecodingStats,
    timing_metrics,
)
from specport.runtime.speculative.verify import Verifier, make_verifier

logger = logging.getLogger(__name__)

MAX_DRAFT_SLACK = 17  # positions past a row's budget a wide run may write (1 + MAX_DRAFT)

OnRowToken = Callable[[int, int], "bool | None"]


@dataclass
class RowsOutput:
    tokens: list[list[int]]  # new tokens per row (EOS included when it ended the row)
    finish_reasons: list[str]  # "eos" | "length" | "stop" | "context"
    metrics: dict[str, Any] = field(default_factory=dict)


def generate_rows(
    model: Any,  # specport.api.Model (shared layout)
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    make_proposer: Callable[[], Proposer] | None,
    num_draft: int,
    sampling: SamplingConfig | None = None,
    eos_ids: Sequence[int] = (),
    on_token: OnRowToken | None = None,
    adaptive: bool = False,
    method: str = "custom",
) -> RowsOutput:
    """Decode ``prompts`` together through the one step (see the module docstring)."""
    manifest = model.manifest
    limit = context_limit(manifest)
    rows = check_prompts(prompts, max_new_tokens, limit, manifest.vocab_size)
    n = len(rows)
    sampling = sampling or SamplingConfig()
    sampler = Sampler(sampling, manifest.vocab_size)
    verifier = make_verifier(sampler)  # chosen once, from the request's settings
    budgets = [min(max_new_tokens, limit - len(r)) for r in rows]
    length = min(limit, max(len(r) + b for r, b in zip(rows, budgets)) + MAX_DRAFT_SLACK)
    cache = SharedKVCache(model.session, manifest, n, length)
    batched = n == 1 or takes_batched_steps(Path(model.path) / manifest.model_file)
    proposers: list[Proposer | None] = []
    for r in range(n):
        proposer = make_proposer() if make_proposer is not None else None
        if proposer is not None:
            proposer.start(sampling, stream=r)  # rows draw from independent (seeded) streams
        proposers.append(proposer)
    controllers = [AdaptiveDraftLength(num_draft) if adaptive else None for _ in range(n)]
    stats = [SpecDecodingStats() for _ in range(n)]
    contexts = [list(r) for r in rows]
    out: list[list[int]] = [[] for _ in range(n)]
    reasons = ["length"] * n
    live = list(range(n))
    eos = {int(e) for e in eos_ids}
    runs = 0
    propose_s = 0.0

    t_start = time.perf_counter()
    for r, prompt in enumerate(rows):  # all but the last token: the first step feeds it
        if len(prompt) > 1:
            cache.step_row(r, np.asarray(prompt[:-1], dtype=np.int64), last_only=True)
    t_prefill = time.perf_counter()
    prefill_ort = cache.ort_seconds
    t_first: float | None = None
    while live:
        plan = []
        for r in live:
            row = step.StepRow(r, contexts[r], _picker(sampling, verifier, contexts[r]))
            row.proposer, row.verifier = proposers[r], verifier
            if proposers[r] is not None:
                room = min(budgets[r] - len(out[r]) - 1, length - 1 - int(cache.lengths[r]))
                ctl = controllers[r]
                row.cap = min(num_draft if ctl is None else ctl.choose(), room)
            plan.append(row)
        t0 = time.perf_counter()
        widest = step.propose(plan)
        propose_s += time.perf_counter() - t0
        groups: list[tuple[list[step.StepRow], int, bool]] = []
        if batched or widest == 0:
            width = 1 + widest
            if not cache.fits(plan[-1].row + 1, width):
                width = 1  # a finished row near the end of its buffer: decode plainly
            groups.append((plan, width, False))
        else:  # drafts verify one row at a time, the rest decode together
            plain = [p for p in plan if int(p.drafts.lengths[0]) == 0]
            groups += [([p], 1 + int(p.drafts.lengths[0]), True) for p in plan if p not in plain]
            if plain:
                groups.append((plain, 1, False))
        for group, width, alone in groups:
            verdicts = step.run(cache, group, width, alone)
            runs += 1
            for row, verdict in zip(group, verdicts):
                r = row.row
                if verdict.error is not None:
                    raise RuntimeError(verdict.error)
                if proposers[r] is not None:
                    stats[r].observe_draft(verdict.drafted, verdict.accepted)
                    ctl = controllers[r]
                    if ctl is not None:
                        ctl.observe(verdict.drafted, verdict.accepted)
                for tok in verdict.tokens:
                    out[r].append(tok)
                    contexts[r].append(tok)
                    why = stop_reason(
                        tok,
                        len(out[r]),
                        eos,
                        None if on_token is None else (lambda t, r=r: on_token(r, t)),
                        budgets[r],
                        max_new_tokens,
                    )
                    if why is not None:
                        reasons[r] = why
                        live.remove(r)
                        break
        if t_first is None:
            t_first = time.perf_counter()
    t_end = time.perf_counter()
    return RowsOutput(
        out,
        reasons,
        _metrics(
            rows, out, stats, runs, (t_start, t_prefill, t_first or t_end, t_end),
            cache.ort_seconds - prefill_ort, propose_s, method, num_draft, adaptive,
            make_proposer is not None,
        ),
    )  # fmt: skip


def _picker(sampling: SamplingConfig, verifier: Verifier, context: list[int]) -> step.Pick:
    """A row's token without drafts: the graph's argmax under plain greedy decoding, else the
    verifier's choice from the target's scores (penalties, grammar, the seeded stream)."""
    if sampling.greedy and sampling.plain:
        return lambda logits, greedy: greedy if greedy is not None else int(np.argmax(logits[0]))
    return lambda logits, greedy: int(verifier.chain(_EMPTY, logits[None], (context,)).tokens[0][0])


_EMPTY = Drafts.empty(1)


def _metrics(
    rows: list[list[int]],
    out: list[list[int]],
    stats: list[SpecDecodingStats],
    runs: int,
    clock: tuple[float, float, float, float],
    decode_ort: float,
    propose_s: float,
    method: str,
    num_draft: int,
    adaptive: bool,
    speculative: bool,
) -> dict[str, Any]:
    """The generators' timing keys (``speculative.metrics.timing_metrics``, the same keys as
    every loop) for a batch, plus the acceptance counters per row."""
    first_s, prefill, first, end = clock
    metrics = timing_metrics(
        sum(len(r) for r in rows),
        sum(len(o) for o in out),
        runs,
        {"start": first_s, "prefill": prefill, "first": first, "end": end},
        decode_ort,
        0.0,
        propose_s,
    )
    metrics.update(batch=len(rows), kv_layout="shared")
    if speculative:
        total = SpecDecodingStats()
        for st in stats:
            total.merge(st)
        metrics["speculative"] = {
            "method": method,
            "num_draft": num_draft,
            "adaptive": adaptive,
            **total.as_dict(),
            "rows": [st.as_dict() for st in stats],
        }
    return metrics
