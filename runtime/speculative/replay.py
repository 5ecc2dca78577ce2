"""Drafts that are always right: the speculation ceiling of a machine and a model.

`ReplayProposer` drafts a continuation known in advance (plain greedy's own output). Every
draft is accepted, so a run with it measures what speculation costs when nothing is wasted:
the verify runs over 1 + K tokens, the cache bookkeeping, the loop. Its speed-up over plain
decoding is the most any proposer can gain at draft length K on this machine, which tells a
user (and us) whether a target such as "2x at 2.5 accepted tokens per step" is reachable
before any proposer is trained: on a compute-bound CPU a verify run of 5 tokens can cost
well over a plain step, and then even perfect drafts pay little.
"""

from __future__ import annotations

from collections.abc import Sequence

from specport.runtime.speculative.base import Drafts, ProposerBase


class ReplayProposer(ProposerBase):
    """Drafts the next tokens of ``continuation``, the known output after the prompt. Past
    its end it drafts nothing; off its track, nothing too, or with ``keep_width`` the last
    token repeated: a guess that keeps every verify run as wide as on the track, so that the
    run's own output is what wide verify runs choose (on int8-activation artifacts they
    round differently from one-token steps, and the bench's ceiling reruns on that output)."""

    name = "ceiling"

    def __init__(
        self, prompt: Sequence[int], continuation: Sequence[int], keep_width: bool = False
    ) -> None:
        self.prompt = [int(t) for t in prompt]
        self.continuation = [int(t) for t in continuation]
        self.keep_width = keep_width

    def propose(self, context: list[list[int]], num_draft: int) -> Drafts:
        return Drafts.from_lists([self._row(row, num_draft) for row in context])

    def _row(self, row: list[int], num_draft: int) -> list[int]:
        produced = len(row) - len(self.prompt)
        k = max(int(num_draft), 0)
        if produced < 0 or row[len(self.prompt) :] != self.continuation[:produced]:
            return [row[-1]] * k if self.keep_width and row else []  # off this track
        return self.continuation[produced : produced + k]
