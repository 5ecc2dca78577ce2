"""Acceptance counters for speculative decoding.

Counted per verify step of one sequence ("step"): how many drafts were proposed and accepted,
and at which draft positions. Position-wise rates show where a proposer stops being useful
(MTP heads usually hold up for 1-2 positions, n-gram in bursts), which is how ``num_draft``
should be tuned. Sinks (log line, bench JSON) read ``as_dict``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

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

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """One sequence, one step: ``num_accepted_tokens`` of ``num_draft_tokens`` accepted."""
        if not 0 <= num_accepted_tokens <= num_draft_tokens:
            raise ValueError(f"accepted {num_accepted_tokens} not in [0, {num_draft_tokens}]")
        self._grow(num_draft_tokens)
        self.num_steps += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for i in range(num_draft_tokens):
            self.drafted_per_pos[i] += 1
        for i in range(num_accepted_tokens):
            self.accepted_per_pos[i] += 1

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
