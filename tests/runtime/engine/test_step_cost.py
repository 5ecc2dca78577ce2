"""The batched step cost model and the verify width it picks (runtime/engine/step_cost.py)."""

from __future__ import annotations

import numpy as np
import pytest

from specport.runtime.engine.step_cost import StepCost, best_width
from specport.runtime.kv.cache import SharedKVCache
from specport.runtime.speculative.metrics import AdaptiveDraftLength


def test_fit_recovers_a_line_and_never_a_negative_slope():
    line = StepCost.fit([(1, 0.030), (8, 0.065), (16, 0.105)])
    assert line.base == pytest.approx(0.030, abs=2e-3)
    assert line.per_token == pytest.approx(0.005, abs=3e-4)
    assert line(16) == pytest.approx(0.105, abs=3e-3)
    flat = StepCost.fit([(1, 0.05), (8, 0.04), (16, 0.03)])
    assert flat.per_token == 0.0 and flat(16) == flat(1) == pytest.approx(0.04)


def _geometric(rate: float, k: int) -> list[float]:
    return [sum(rate**i for i in range(j + 1)) for j in range(k + 1)]


def test_rows_without_drafts_keep_a_compute_bound_step_plain():
    """4 rows, a step cost of 30 ms + 5 ms per extra token: one row drafting 4 good tokens
    does not pay for padding the other three to width 5; all four drafting do."""
    cost = StepCost(0.030, 0.005)
    good = _geometric(0.95, 4)
    one = best_width(cost, 4, [4, 0, 0, 0], [good, [1.0], [1.0], [1.0]])
    assert one == 1
    assert best_width(cost, 4, [4] * 4, [good] * 4) == 5
    poor = _geometric(0.2, 4)
    assert best_width(cost, 4, [4] * 4, [poor] * 4) == 1
    assert best_width(cost, 4, [4] * 4, [good] * 4, max_tokens=12) == 3  # the cap


def test_free_tokens_verify_at_the_widest_row():
    expected = [_geometric(0.5, 2), [1.0], _geometric(0.5, 3)]
    assert best_width(StepCost(1.0, 0.0), 3, [2, 0, 3], expected) == 4


def test_expected_tokens_follow_the_controller_rates():
    controller = AdaptiveDraftLength(3)
    controller.rate = [0.5, 0.5, 1.0]
    assert controller.expected_tokens(3) == [1.0, 1.5, 1.75, 2.0]
    assert controller.expected_tokens(1) == [1.0, 1.5]


def test_calibrate_measures_free_rows_and_puts_their_lengths_back(shared_model):
    slots = SharedKVCache(shared_model.session, shared_model.manifest, 3, 64)
    slots.lengths[:] = [0, 5, 0]
    cost = StepCost.calibrate(slots, 3)
    assert cost.base > 0.0 and cost.per_token >= 0.0
    np.testing.assert_array_equal(slots.lengths, [0, 5, 0])


def test_declined_steps_let_the_engine_wide_rates_recover(shared_model):
    """Rows without their own controller are expected to accept what every row's
    verifications accepted; a step that verifies nothing (a plain step paid more) pulls those
    rates back toward the prior, so a workload that recovers is tried again."""
    from specport.runtime.engine.speculation import EngineSpeculation

    spec = EngineSpeculation(shared_model, "ngram", num_draft=3)
    spec.cost = StepCost(0.03, 0.005)
    for _ in range(10):
        spec.shared.observe(3, 0)
    low = spec.shared.rate[0]
    assert low < 0.1
    assert spec.width(4, [(None, 3)] * 4) == 1
    assert spec.shared.rate[0] > low
    for _ in range(200):
        spec.width(4, [(None, 3)] * 4)
    assert spec.width(4, [(None, 3)] * 4) > 1


def test_timed_steps_correct_a_verify_cost_measured_too_low():
    """The start-up line says a width-2 run over 4 rows costs 1.1x a plain step; the engine's
    timed runs say 2x: after a few of them a plain step wins again."""
    cost = StepCost(0.030, 0.0005)
    expected = [_geometric(0.7, 1)] * 4
    assert best_width(cost, 4, [1] * 4, expected) == 2
    for _ in range(20):
        cost.observe(4, cost(4), verify=False)
        cost.observe(8, 2.0 * cost(4), verify=True)
    assert cost.verify_scale > 1.5 and cost.plain_scale == pytest.approx(1.0)
    assert best_width(cost, 4, [1] * 4, expected) == 1


@pytest.mark.parametrize("fails", [None, "fsync", "replace"])
def test_kept_costs_are_written_whole_or_not_at_all(tmp_path, monkeypatch, fails):
    """The kept step costs survive a write that fails halfway (a full disk, a crash before the
    rename): the old file stays whole JSON and no temp file is left beside it."""
    import json
    import os

    from specport.runtime.engine import step_cost

    monkeypatch.setenv("SPECPORT_CACHE", str(tmp_path))
    step_cost._write("old", {"widths": [1, 2], "seconds": [1.0, 1.5]})
    path = tmp_path / "step_costs.json"
    path.chmod(0o640)
    if fails:

        def broken(*args, **kwargs):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(os, fails, broken)
    step_cost._write("new", {"widths": [1, 2], "seconds": [1.0, 1.25]})
    kept = json.loads(path.read_text())
    assert sorted(kept) == (["old"] if fails else ["new", "old"])
    assert [p.name for p in tmp_path.iterdir()] == ["step_costs.json"]
    assert path.stat().st_mode & 0o777 == 0o640


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 16, 17, 18, 19, 63, 64])
def test_lower_quartile_is_numpys(n):
    """The live corrections' plain-Python quartile gives np.quantile(x, 0.25) exactly."""
    from collections import deque

    from specport.runtime.engine.step_cost import lower_quartile

    x = np.random.default_rng(n).exponential(0.01, n)
    assert lower_quartile(deque(x.tolist(), maxlen=64)) == float(np.quantile(x, 0.25))
