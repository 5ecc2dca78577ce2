"""Speculative decoding inside the continuous-batching engine, on the shared (in-place) KV layout.

Each request that speculates holds its own proposer (n-gram, draft model, MTP heads; taken
from a pool, so a draft model's KV buffers are allocated once per pool slot, not per request),
its own draft length controller (`AdaptiveDraftLength`, when the method adapts by default) and
its own acceptance counters. A speculative step of row r feeds [last token, k drafts] at the
row's length and verifies the k+1 scores; rejected drafts are rolled back by moving the row's
length back (`KVCache.keep`), never by copying KV. This module holds that per-request state
and the scheduling rule (`EngineSpeculation`); the step that drafts, verifies and commits is
`engine/step.py`, the same for every row.

The compute-bound rule: rows verify one by one while at most `max_rows` (`SPEC_MAX_ROWS`) rows
decode; above that every row proposes (up to `max_tokens` / rows - 1 drafts) and the run's width
is the one with the most expected tokens per second (`EngineSpeculation.width`): each row's
expected tokens at k drafts come from its acceptance so far (`AdaptiveDraftLength` rates), the
run's cost from the line the engine measured on its own buffers at start
(`step_cost.StepCost`). Width 1 means a plain batched step pays best. A dense [rows, width]
run makes every row pay the width, drafts or not, and on a CPU the run is compute-bound from a
handful of tokens on (SmolLM2-135M, 2 threads: ~32 ms + ~4.8 ms per extra token), so rows
without drafts or with poor acceptance keep the step plain. Row-by-row costs, measured on
SmolLM2-135M (1 thread, 2-core machine, load ~2.5): a batched step over b rows costs 1.12x
(b=2), 1.23x (b=4), 2.38x (b=8) a batch-1 step, and a batch-1 verify of 1 + k tokens
1.08-1.21x (k = 1..5), so b rows verifying one by one pay only while each verify yields more
than ~1.15 b / c(b) tokens: by default only a request decoding alone verifies at batch 1.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from specport.runtime.engine.step_cost import StepCost, best_width, verify_costs
from specport.runtime.sampler import Sampler, SamplingConfig
from specport.runtime.speculative.base import Proposer
from specport.runtime.speculative.loop import default_adaptive, make_proposer
from specport.runtime.speculative.metrics import AdaptiveDraftLength, SpecDecodingStats
from specport.runtime.speculative.verify import GREEDY, Verifier, make_verifier

logger = logging.getLogger(__name__)

SPEC_MAX_ROWS = 1  # verify row by row only while this many rows (or fewer) decode
# rows x (1 + drafts) of a run verifying rows together stays within this: 16 rows decode
# plainly (SmolLM2-135M, 2 threads: letting the step cost decide there measured 0.84x)
SPEC_MAX_TOKENS = 24

__all__ = [
    "SPEC_MAX_ROWS",
    "SPEC_MAX_TOKENS",
    "EngineSpeculation",
    "RowSpec",
]


@dataclass
class RowSpec:
    """One request's speculation state (lives as long as the request's row)."""

    proposer: Proposer
    controller: AdaptiveDraftLength | None
    verifier: Verifier = GREEDY  # chosen once from the request's sampling (`verify.make_verifier`)
    stats: SpecDecodingStats = field(default_factory=SpecDecodingStats)


class EngineSpeculation:
    """Proposers, verification and counters for the engine's speculating rows."""

    def __init__(
        self,
        model: Any,  # specport.api.Model (the target)
        method: str,
        num_draft: int | None = None,
        draft: Any = None,  # a draft Model or artifact path, for method="draft"
        max_rows: int = SPEC_MAX_ROWS,
        adaptive: bool | None = None,
        max_tokens: int = SPEC_MAX_TOKENS,
    ) -> None:
        self.model, self.method = model, method
        self.num_draft = model.num_draft_for(method, num_draft)
        self.draft = model.draft_model(draft) if method == "draft" else None
        first = make_proposer(method, model, self.num_draft, self.draft)  # clear errors early
        self.adaptive = default_adaptive(first) if adaptive is None else bool(adaptive)
        # what verifying k drafts costs at batch 1, measured once per machine and artifact
        # (kept on disk) here rather than when the first request arrives
        self.verify_costs = verify_costs(model, self.num_draft) if self.adaptive else None
        self.max_rows = int(max_rows)
        self.max_tokens = int(max_tokens)
        self.batched = False  # set by the engine: its graph takes batched multi-token steps
        self.cost: StepCost | None = None  # set by the engine: its measured batched step cost
        # acceptance per draft position over every row's verifications: what rows without
        # their own controller are expected to accept when they verify together
        self.shared = AdaptiveDraftLength(self.num_draft)
        self._pool: list[Proposer] = [first]
        self.needs_outputs = first.needs_outputs  # MTP drafts come out of every run of the row
        self.counters = {
            "spec_steps": 0,  # row verifications
            "spec_draft_tokens": 0,
            "spec_accepted_tokens": 0,
            "spec_batched_steps": 0,  # runs that verified several rows together
        }
        self.totals = SpecDecodingStats()

    # ---- per request -----------------------------------------------------------------
    def attach(
        self, sampling: SamplingConfig, sampler: Sampler | None = None, budget: int | None = None
    ) -> RowSpec | None:
        """The state of a new request, or None when its sampling cannot be verified losslessly
        here (presence / frequency penalties, logit bias, a grammar: it decodes plainly);
        ``budget``: the most new tokens it may make."""
        if (
            sampling.presence_penalty
            or sampling.frequency_penalty
            or sampling.logit_bias
            or sampling.constraint is not None
        ):
            return None
        proposer = (
            self._pool.pop()
            if self._pool
            else make_proposer(self.method, self.model, self.num_draft, self.draft)
        )
        proposer.start(sampling, budget=budget)
        controller = AdaptiveDraftLength(self.num_draft, extend=True) if self.adaptive else None
        if controller is not None and sampling.greedy and self.verify_costs is not None:
            # the verify costs measured on this machine, not the linear prior (where one
            # more token costs a lot, e.g. int8 activations, drafting pays less); under
            # sampling the draft length must not depend on a measurement (seeded requests)
            controller.set_verify_costs(self.verify_costs)
        return RowSpec(proposer, controller, make_verifier(sampler))

    def detach(self, spec: RowSpec, answer: Sequence[int] = ()) -> None:
        """The request left its row: its proposer goes back to the pool (suffix drafting
        learns its answer)."""
        self.totals.merge(spec.stats)
        self._pool.append(spec.proposer)
        spec.proposer.finish(answer)

    # ---- per step --------------------------------------------------------------------
    def active(self, decoding_rows: int) -> bool:
        """The compute-bound rule: speculate only while few rows decode (`SPEC_MAX_ROWS`)."""
        return decoding_rows <= self.max_rows

    def together(self, decoding_rows: int) -> bool:
        """Verify every decoding row in one batched run this step? Only where the graph takes
        several new tokens per row at batch > 1 (`batched`), for proposers that need no
        per-row outputs of the run (not MTP), and while every row can draft at least one token
        within `max_tokens` tokens per run (`draft_cap`)."""
        return (
            self.batched
            and self.cost is not None
            and not self.needs_outputs
            and self.draft_cap(decoding_rows) >= 1
        )

    def width(self, batch: int, plans: list[tuple[RowSpec | None, int]]) -> int:
        """The width (1 + drafts) a run over `batch` rows should verify at, given each
        decoding row's state and drafts: the best expected tokens per second of the measured
        step cost (`best_width`); 1 means a plain batched step pays more."""
        assert self.cost is not None
        expected = [
            (self.shared if s is None or s.controller is None else s.controller).expected_tokens(d)
            for s, d in plans
        ]
        drafts = [d for _, d in plans]
        width = best_width(self.cost, batch, drafts, expected, self.max_tokens)
        if width == 1:  # nothing gets verified: let the rates drift back, to be tried again
            self.shared.observe(0, 0)
        return width

    def draft_cap(self, decoding_rows: int) -> int:
        """Drafts per row when `decoding_rows` rows verify together: rows x (1 + drafts) stays
        within `max_tokens`, so a step's cost stays near a plain batched step's."""
        return min(self.num_draft, self.max_tokens // max(1, decoding_rows) - 1)

    def num_draft_of(self, spec: RowSpec) -> int:
        """How many drafts the request wants this step (its controller's choice, when it
        adapts)."""
        return self.num_draft if spec.controller is None else spec.controller.choose()

    def count(self, spec: RowSpec, drafted: int, accepted: int) -> None:
        """A row verified `drafted` drafts and accepted `accepted` of them."""
        spec.stats.observe_draft(drafted, accepted)
        self.counters["spec_steps"] += 1
        self.counters["spec_draft_tokens"] += drafted
        self.counters["spec_accepted_tokens"] += accepted
        self.shared.observe(drafted, accepted)
        if spec.controller is not None:
            spec.controller.observe(drafted, accepted)

    def stats(self) -> dict[str, Any]:
        return {
            **self.counters,
            "speculative": self.method,
            "spec_num_draft": self.num_draft,
            "spec_max_rows": self.max_rows,
            "spec_max_tokens": self.max_tokens,
            "spec_batched": self.batched,
            "spec_step_cost_ms": None
            if self.cost is None
            else [
                round(1e3 * self.cost.base, 2),
                round(1e3 * self.cost.per_token, 3),
                round(self.cost.plain_scale, 3),
                round(self.cost.verify_scale, 3),
            ],
        }
