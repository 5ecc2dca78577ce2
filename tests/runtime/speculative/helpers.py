"""What the speculative tests share: a proposer whose drafts are nearly always wrong, and the
target's law of its first two sampled tokens that rejection sampling must keep."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from specport.runtime.kv.seq_cache import open_cache
from specport.runtime.sampler import Sampler, SamplingConfig
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


def first_two_law(
    model: Any, ids: list[int], config: SamplingConfig
) -> dict[tuple[int, int], float]:
    """The target's joint law of the first two tokens sampled after `ids` under `config`:
    p(t1) p(t2 | t1), from one run per possible first token."""
    sampler = Sampler(config, model.manifest.vocab_size)
    logits = open_cache(model.session, model.manifest).step(ids).logits[None]
    p1 = sampler.probs(logits[:, -1])[0]
    law: dict[tuple[int, int], float] = {}
    for t1 in np.flatnonzero(p1):
        l2 = open_cache(model.session, model.manifest).step([*ids, int(t1)]).logits[None]
        p2 = sampler.probs(l2[:, -1])[0]
        for t2 in np.flatnonzero(p2):
            law[(int(t1), int(t2))] = p1[t1] * p2[t2]
    return law


def total_variation(counts: Counter[tuple[int, int]], law: dict[tuple[int, int], float]) -> float:
    """Total variation distance between the counted pairs' frequencies and `law`; a pair the
    law gives no mass is a failure by itself."""
    n = sum(counts.values())
    assert set(counts) <= set(law), set(counts) - set(law)
    return 0.5 * sum(abs(counts[c] / n - p) for c, p in law.items())
