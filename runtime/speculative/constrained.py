"""Greedy speculative verification under a grammar (structured outputs): a draft token the
grammar forbids is never accepted.

Plain constrained greedy picks, at each position, the argmax of the logits masked by the
grammar's state there. Verification does exactly that along the draft: at position i the mask
is the grammar's state after the drafts accepted so far; draft i is accepted only when it is
that masked argmax (a forbidden token never is, whatever the model thinks of it), and the
first position where it is not gives the bonus token. The grammar advances by exactly the
tokens returned, so nothing is rolled back, and the output is plain constrained greedy's,
token for token.
"""

from __future__ import annotations

import numpy as np

from specport.runtime.sampler import Sampler
from specport.runtime.speculative.base import Drafts
from specport.runtime.speculative.verify import VerifyResult


def constrained_greedy_verify(
    drafts: Drafts, logits: np.ndarray, sampler: Sampler, context: list[int]
) -> VerifyResult:
    """logits [1, K+1, V] of one sequence; `sampler.config` is greedy with a `constraint`."""
    constraint = sampler.config.constraint
    penalized = sampler.config.repetition_penalty != 1.0
    row = drafts.row(0)
    a = 0
    while True:
        history = [np.asarray(context + row[:a], dtype=np.int64)] if penalized else None
        scores = constraint.mask(sampler.scores(logits[0, a : a + 1], history))
        best = int(np.argmax(scores[0]))
        constraint.accept(best)
        if a < len(row) and row[a] == best:
            a += 1
            continue
        break
    accepted = np.array([a], dtype=np.int64)
    return VerifyResult(accepted, [[*row[:a], best]], accepted == drafts.lengths)
