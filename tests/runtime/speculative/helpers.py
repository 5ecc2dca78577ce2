"""What the speculative tests share: a proposer whose drafts are nearly always wrong."""

from __future__ import annotations

import numpy as np

from specport.runtime.speculative.base import Drafts


class RandomProposer:
    """Drafts random tokens (ids 3..255): nearly every draft is rejected, exercising the KV
    rollback. With `any_length` each call drafts 0..num_draft of them, so the rows of a batch
    drift apart."""

    name = "random"

    def __init__(self, rng: np.random.Generator | int = 0, any_length: bool = False) -> None:
        self.rng = np.random.default_rng(rng)  # a Generator is used as it is
        self.any_length = any_length

    def propose(self, context: list[list[int]], num_draft: int) -> Drafts:
        k = int(self.rng.integers(0, num_draft + 1)) if self.any_length else num_draft
        return Drafts.from_lists([self.rng.integers(3, 256, size=k).tolist()])
