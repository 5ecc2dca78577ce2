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

from specport.runtime.speculative.base import Drafts


class ReplayProposer:
    """Drafts the next tokens of ``continuation``, the known output after ``prompt_len``
    prompt tokens. Past its end (or off its track) it drafts nothing."""

    name = "ceiling"

    def __init__(self, prompt: Sequence[int], continuation: Sequence[int]) -> None:
        self.prompt = [int(t) for t in prompt]
        self.continuation = [int(t) for t in continuation]

    def propose(self, context: list[list[int]], num_draft: int) -> Drafts:
        return Drafts.from_lists([self._row(row, num_draft) for row in context])

    def _row(self, row: list[int], num_draft: int) -> list[int]:
        produced = len(row) - len(self.prompt)
        if produced < 0 or row[len(self.prompt) :] != self.continuation[:produced]:
            return []  # not the run this continuation came from
        return self.continuation[produced : produced + max(int(num_draft), 0)]
