"""Acceptance counters for speculative decoding.

Counted per verify step of one sequence ("step"): how many drafts were proposed and accepted,
and at which draft positions. Position-wise rates show where a proposer stops being useful
(MTP heads usually hold up for 1-2 positions, n-gram in bursts), which is how ``num_draft``
should be tuned. Sinks (log line, bench JSON) read ``as_dict``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from specport.runtime.speculative.base import Drafts
from specport.runtime.speculative.verify import VerifyResult

logger = logging.getLogger(__name__)


@dataclass
class SpecDecodingStats:
    """Running totals; ``merge`` adds another instance (e.g. per-request into global)."""

    num_steps: int = 0  # sequence-level verify steps (each emits accepted + 1 tokens)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    drafted_per_pos: list[int] = field(default_factory=list)
    accepted_per_pos: list[int] = field(default_factory=list)

    def _grow(self, n: int) -> None:
        for counts in (self.drafted_per_pos, self.accepted_per_pos):
            counts.extend([0] * (n - len(counts)))

    def observe_draft(
        self, num_draft_tokens: int, num_accepted_tokens: int, count: int = 1
    ) -> None:
        """One sequence, one step (``count`` alike steps): ``num_accepted_tokens`` of
        ``num_draft_tokens`` accepted."""
        if not 0 <= num_accepted_tokens <= num_draft_tokens:
            raise ValueError(f"accepted {num_accepted_tokens} not in [0, {num_draft_tokens}]")
        self.num_steps += count
        if not num_draft_tokens:  # most steps of a sparse drafter: nothing per position
            return
        self._grow(num_draft_tokens)
        self.num_draft_tokens += num_draft_tokens * count
        self.num_accepted_tokens += num_accepted_tokens * count
        for i in range(num_draft_tokens):
            self.drafted_per_pos[i] += count
        for i in range(num_accepted_tokens):
            self.accepted_per_pos[i] += count

    def observe(self, drafts: Drafts, result: VerifyResult, rows: np.ndarray | None = None) -> None:
        """A batch step; ``rows`` limits counting to live sequences (default: all)."""
        for b in range(drafts.batch_size) if rows is None else rows:
            self.observe_draft(int(drafts.lengths[b]), int(result.accepted[b]))

    def merge(self, other: SpecDecodingStats) -> None:
        self._grow(len(other.drafted_per_pos))
        self.num_steps += other.num_steps
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        for i, (d, a) in enumerate(zip(other.drafted_per_pos, other.accepted_per_pos)):
            self.drafted_per_pos[i] += d
            self.accepted_per_pos[i] += a

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted over all positions (0.0 before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verify step: 1 + accepted / steps (1.0 = no speed-up)."""
        return 1.0 + self.num_accepted_tokens / self.num_steps if self.num_steps else 0.0

    @property
    def acceptance_rate_per_pos(self) -> list[float]:
        """P(draft i accepted | draft i proposed), i = 0..K-1."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_pos, self.drafted_per_pos)]

    def as_dict(self) -> dict:
        return {
            "steps": self.num_steps,
            "drafted": self.num_draft_tokens,
            "accepted": self.num_accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "drafted_per_position": list(self.drafted_per_pos),
            "accepted_per_position": list(self.accepted_per_pos),
            "acceptance_rate_per_position": self.acceptance_rate_per_pos,
        }

    def log(self, prefix: str = "spec decode") -> None:
        logger.info(
            "%s: mean accepted length %.2f, acceptance %.1f%%, per position %s",
            prefix,
            self.mean_accepted_length,
            100 * self.acceptance_rate,
            ", ".join(f"{r:.2f}" for r in self.acceptance_rate_per_pos),
        )


SLACK = 0.02  # draft lengths whose expected value is this close to the best count as ties


class AdaptiveDraftLength:
    """Chooses K per step from an exponential moving average of recent acceptance per position.

    ``rate[i]`` estimates P(draft i accepted | drafts 0..i-1 accepted): a step that drafted
    ``d`` and accepted ``a`` updates positions 0..min(a, d-1) (1 before ``a``, 0 at ``a``);
    later positions were never put to the test. The expected tokens of a step with k drafts are
    ``1 + sum_{i<k} prod_{j<=i} rate[j]`` and its cost grows by ``cost_per_draft`` (relative to
    a plain step) per fed draft, so ``choose`` returns the k in 0..max_draft that maximizes
    tokens per cost. Positions not drafted for a while drift back to ``prior`` so that a
    proposer that recovers (an n-gram entering a repeated passage) is tried again.

    ``cost_per_draft`` starts as the verify cost of one more fed token; ``observe_cost`` adds
    what proposing costs, measured (a draft model runs once per draft, MTP drafts are free).

    ``set_verify_costs`` replaces the linear verify prior by the measured cost of verifying k
    drafts (``engine.step_cost.verify_costs``: on a CPU one more token costs little until the
    run turns compute-bound, and the first extra token costs most); ``best`` then ranks any
    expected-tokens curve, which is how the hybrid proposer compares its sources.

    ``extend``: a position never yet put to the test is estimated at the rate of the deepest
    one that was (the prior only while none was). With a fixed prior a controller that found
    one draft worth it never learned that the second was too: SmolLM2's own 4-bit file,
    drafting for its fp32 export, was right 0.97 of the time at position 0 while positions 1-3
    stayed at the 0.6 prior, so every step drafted one token (1.97 per step, 1.09x plain,
    where a fixed K of 4 made 4.67 per step and 1.23x). A too hopeful estimate is tested the
    next step and corrected; a too timid one was never tested. For the same reason, with
    ``extend`` a position not drafted drifts toward the estimate of the position before it,
    not back to the prior: SmolLM2's own 4-bit file, right 0.97 of the time at every position,
    missed twice at its second early in a run; that position then drifted to the 0.75 prior,
    which with a two-draft verify costing 1.29 plain steps against 1.07 for one never paid
    for a test, and one draft per step looked best for the rest of the run (`auto` 2.4 tokens
    per step and 1.5x plain, against 5.1 and 1.8x in the runs without the early misses).
    """

    def __init__(
        self,
        max_draft: int,
        cost_per_draft: float = 0.08,
        decay: float = 0.8,
        prior: float = 0.6,
        drift: float = 0.05,
        extend: bool = False,
    ) -> None:
        if max_draft < 1:
            raise ValueError(f"max_draft must be >= 1, got {max_draft}")
        self.max_draft = int(max_draft)
        self.cost_per_draft = float(cost_per_draft)
        self.decay = float(decay)
        self.prior = float(prior)
        self.drift = float(drift)
        self.extend = bool(extend)
        self.rate = [self.prior] * self.max_draft
        self.tested = [False] * self.max_draft  # positions an observed step put to the test
        self.verify_cost = self.cost_per_draft  # what one more fed token costs the verify run
        self.prior_cost = self.cost_per_draft  # where an unmeasured cost drifts back to
        self.propose_cost = 0.0  # per step that drafts anything, relative to a plain step
        self.verify_costs: list[float] | None = None  # measured: verifying k drafts, k = 0..

    def set_verify_costs(self, costs: list[float]) -> None:
        """Measured verify costs (``costs[k]``: a step verifying k drafts, a plain step = 1).
        What proposing adds per draft stays in ``cost_per_draft - verify_cost``."""
        if len(costs) < 2:
            return
        extra = self.cost_per_draft - self.verify_cost
        self.verify_costs = [float(c) for c in costs]
        self.verify_cost = max((self.verify_costs[-1] - 1.0) / (len(costs) - 1), 0.0)
        self.cost_per_draft = self.verify_cost + extra
        self.prior_cost = self.cost_per_draft

    def step_cost(self, k: int) -> float:
        """What a step verifying ``k`` drafts costs, a plain step being 1."""
        if k <= 0:
            return 1.0
        if self.verify_costs is None:
            return 1.0 + self.propose_cost + self.cost_per_draft * k
        costs = self.verify_costs
        verify = costs[k] if k < len(costs) else costs[-1] + self.verify_cost * (k - len(costs) + 1)
        return verify + self.propose_cost + (self.cost_per_draft - self.verify_cost) * k

    def best(self, expected: list[float]) -> tuple[int, float]:
        """(k, expected tokens per unit of cost) of the best k for a curve of expected tokens
        at k = 0..len-1 drafts, the shortest within ``SLACK`` of the best; k = 0 (plain
        decoding, value 1) when no draft pays."""
        values = [1.0] + [expected[k] / self.step_cost(k) for k in range(1, len(expected))]
        top = max(values)
        if top <= 1.0:
            return 0, 1.0
        # the shortest draft within SLACK of the best: a long draft's value rests on estimates
        # of its deep positions, tested least, so near-ties go to the shorter one (drafting
        # at all is decided without slack: a draft not made is never tested)
        best_k = next(k for k in range(1, len(values)) if values[k] >= top * (1.0 - SLACK))
        return best_k, values[best_k]

    def observe_cost(
        self, drafted: int, propose_s: float, rest_s: float, per_draft: bool = False
    ) -> None:
        """Timings of one step that asked for ``drafted`` tokens: proposing, and the rest of
        the step (verify run and host work), which stands for the cost of a plain step.

        ``per_draft``: proposing costs per draft (a draft model runs once per token) rather
        than per step (an n-gram lookup).
        """
        if drafted <= 0 or rest_s <= 0.0:
            return
        d = self.decay
        ratio = min(propose_s / rest_s, float(drafted))  # a stall (GC, preemption) is not a trend
        if per_draft:
            cost = self.verify_cost + ratio / drafted
            self.cost_per_draft = d * self.cost_per_draft + (1.0 - d) * cost
        else:
            self.propose_cost = d * self.propose_cost + (1.0 - d) * min(ratio, 1.0)

    def choose(self) -> int:
        """The draft length with the best expected tokens per unit of step cost."""
        return self.best(self.expected_tokens(self.max_draft))[0]

    def expected_tokens(self, max_k: int) -> list[float]:
        """Expected tokens a step emits when it verifies k = 0..max_k drafts (1 + the
        expected accepted prefix), from the current per-position rates."""
        out, reach = [1.0], 1.0
        for rate in self.estimates()[: min(max_k, self.max_draft)]:
            reach *= rate
            out.append(out[-1] + reach)
        return out

    def estimates(self) -> list[float]:
        """Each position's acceptance estimate: its own rate, or with ``extend`` the rate of
        the deepest position tested before it while it was never tested itself."""
        out: list[float] = []
        deepest: float | None = None
        for rate, tested in zip(self.rate, self.tested):
            if tested:
                deepest = rate
            elif self.extend and deepest is not None:
                rate = deepest
            out.append(rate)
        return out

    def observe(self, drafted: int, accepted: int) -> None:
        """One step: ``accepted`` of the ``drafted`` drafts were accepted."""
        d = self.decay
        tested = min(accepted + 1, drafted)
        start = self.estimates()
        for i in range(self.max_draft):
            if i < tested:
                if not self.tested[i]:  # from the estimate the choice was made with
                    self.rate[i] = start[i]
                    self.tested[i] = True
                self.rate[i] = d * self.rate[i] + (1.0 - d) * (1.0 if i < accepted else 0.0)
            elif i >= drafted:
                # with ``extend``, toward the position before it (class docstring)
                target = self.rate[i - 1] if self.extend and i > 0 else self.prior
                self.rate[i] += self.drift * (target - self.rate[i])
        if drafted == 0:  # costs are measured only while drafting: let them be tried again
            self.propose_cost -= self.drift * self.propose_cost
            self.cost_per_draft += self.drift * (self.prior_cost - self.cost_per_draft)


def timing_metrics(
    prompt_tokens: int,
    new_tokens: int,
    steps: int,
    clock: dict[str, float | None],
    ort_s: float,
    prefill_ort_s: float,
    propose_s: float,
) -> dict[str, Any]:
    """The plain generator's timing keys for one speculative run (batch 1).

    ``clock`` holds perf_counter stamps ``start``, ``prefill`` (prefill done), ``first`` (first
    token emitted, or None) and ``end``. Every loop reports through here so the bench compares
    like with like."""
    start, prefill, end = (
        float(clock["start"] or 0),
        float(clock["prefill"] or 0),
        float(clock["end"] or 0),
    )
    first = clock.get("first") or end
    decode_wall = end - prefill
    return {
        "batch": 1,
        "prompt_tokens": prompt_tokens,
        "new_tokens": new_tokens,
        "ttft_ms": round((first - start) * 1e3, 3),
        "prefill_s": round(prefill - start, 6),
        "prefill_tok_per_s": round(prompt_tokens / max(first - start, 1e-9), 2),
        "decode_steps": steps,
        "decode_tok_per_s": round(new_tokens / decode_wall, 2) if decode_wall > 0 else None,
        "tpot_ms": round(decode_wall / new_tokens * 1e3, 4) if new_tokens else None,
        "decode_ort_s": round(ort_s - prefill_ort_s, 6),
        "decode_wall_s": round(decode_wall, 6),
        "framework_overhead_pct": (
            round(100 * (1 - (ort_s - prefill_ort_s) / decode_wall), 2) if decode_wall > 0 else None
        ),
        "propose_s": round(propose_s, 6),
        "step_overhead_ms": overhead_ms(decode_wall, ort_s - prefill_ort_s, steps),
        "total_s": round(end - start, 6),
    }


def overhead_ms(wall_s: float, ort_s: float, steps: int) -> float | None:
    """The step's own cost: wall time outside onnxruntime per step, in ms (None without steps).

    What a decode step costs beyond the model run itself (proposing, verifying, committing to
    the KV cache, bookkeeping): the figure that decides whether speculation can pay where a
    model run is cheap. Every loop and the engine report it under ``step_overhead_ms``."""
    return round((wall_s - ort_s) / steps * 1e3, 4) if steps else None


def step_overhead_ms(metrics: dict[str, Any]) -> float | None:
    """``step_overhead_ms`` of any generation's metrics (plain, speculative, tree, batched),
    computed from ``decode_wall_s``, ``decode_ort_s`` and ``decode_steps`` when absent."""
    if metrics.get("step_overhead_ms") is not None:
        return float(metrics["step_overhead_ms"])
    try:
        return overhead_ms(
            float(metrics["decode_wall_s"]),
            float(metrics["decode_ort_s"]),
            int(metrics["decode_steps"]),
        )
    except (KeyError, TypeError, ValueError):
        return None
