"""SpecDecodingStats: per-position counts and derived rates."""

from __future__ import annotations

import numpy as np
import pytest

from specport.runtime.speculative.base import Drafts
from specport.runtime.speculative.metrics import SpecDecodingStats
from specport.runtime.speculative.verify import VerifyResult


def test_counts_and_rates():
    stats = SpecDecodingStats()
    stats.observe_draft(3, 3)
    stats.observe_draft(3, 1)
    stats.observe_draft(0, 0)  # a step with nothing drafted still emits one token
    d = stats.as_dict()
    assert d["steps"] == 3 and d["drafted"] == 6 and d["accepted"] == 4
    assert d["drafted_per_position"] == [2, 2, 2]
    assert d["accepted_per_position"] == [2, 1, 1]
    assert d["acceptance_rate_per_position"] == [1.0, 0.5, 0.5]
    assert d["mean_accepted_length"] == pytest.approx(1 + 4 / 3)
    assert d["acceptance_rate"] == pytest.approx(4 / 6)


def test_observe_batch_and_merge():
    drafts = Drafts.from_lists([[1, 2], [3]])
    result = VerifyResult(np.array([1, 1]), [[1, 9], [3, 4]], np.array([False, True]))
    a = SpecDecodingStats()
    a.observe(drafts, result)
    b = SpecDecodingStats()
    b.observe_draft(4, 2)
    a.merge(b)
    assert a.num_steps == 3 and a.drafted_per_pos == [3, 2, 1, 1]
    assert a.accepted_per_pos == [3, 1, 0, 0]
    with pytest.raises(ValueError):
        a.observe_draft(1, 2)


def test_empty_stats():
    d = SpecDecodingStats().as_dict()
    assert d["acceptance_rate"] == 0.0 and d["acceptance_rate_per_position"] == []
