"""Per-row errors of a tied head (passes/quant/head_rows.py): with every token equally frequent
they are the planner's own relative errors, and keeping more of the frequent rows at 8 bits
never costs more error."""

from __future__ import annotations

import numpy as np
import pytest

from specport.passes.quant.blockquant import dequantize
from specport.passes.quant.budget import _rel_errors
from specport.passes.quant.head_rows import (
    measure_head_rows,
    split_points,
    token_frequencies,
)
from specport.passes.quant.rtn import quantize_rtn


def _head(k: int = 64, v: int = 300, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((k, v)).astype(np.float32)
    x = rng.standard_normal((512, k)).astype(np.float32) * np.linspace(0.2, 3.0, k)
    return w, (x.T @ x).astype(np.float32)


@pytest.mark.parametrize("symmetric", [False, True])
def test_uniform_frequencies_give_the_planners_relative_errors(symmetric):
    w, h = _head()
    uniform = np.full(w.shape[1], 1.0 / w.shape[1])
    rows = measure_head_rows(w, h, uniform, [(4, 32), (8, 32)], symmetric)
    for bits in (4, 8):
        head_hat = dequantize(quantize_rtn(w, bits, 32, symmetric))
        table_hat = dequantize(quantize_rtn(w, bits, 32, symmetric=False))
        (head,) = _rel_errors(w, h, [head_hat])
        (table,) = _rel_errors(w, None, [table_hat])
        got = rows.error(0, (8, 32), (bits, 32), head_weight=20.0)
        assert got == pytest.approx(20.0 * head + table, rel=1e-5)


def test_more_frequent_rows_at_8_bits_err_less():
    w, h = _head()
    freq = token_frequencies(w.shape[1])
    rows = measure_head_rows(w, h, freq, [(4, 32), (8, 32)], symmetric=False)
    errors = [rows.error(n, (8, 32), (4, 32), 1.0) for n in [0, *split_points(300), 300]]
    assert errors == sorted(errors, reverse=True)
    assert errors[-1] == pytest.approx(rows.error(0, (8, 32), (8, 32), 1.0))


def test_token_frequencies_follow_the_calibration_tokens():
    prior = token_frequencies(1000)
    assert prior.sum() == pytest.approx(1.0) and np.all(np.diff(prior) < 0)
    ids = np.array([999] * 5000 + [0] * 10)
    seen = token_frequencies(1000, ids)
    assert seen.sum() == pytest.approx(1.0)
    assert seen[999] > 0.5 > seen[0] > seen[500] > 0  # counted, and every id keeps some weight


def test_split_points_are_inside_the_vocabulary():
    assert split_points(49152)[:3] == [1024, 1536, 2048] and split_points(49152)[-1] == 24576
    assert all(0 < n < 256 for n in split_points(256))


def test_loss_factor_comes_from_the_option_the_kl_was_measured_at():
    """A group's KL was measured at 4-bit/32 with integer zero points on the whole tensor; the
    float-zero and split options of the same width and block must not stand in for it (a
    float-zero option nearly exact on a Q4_1 grid made SmolLM2's body factors 1e10)."""
    from specport.passes.quant.budget import Option, Tensor, _apply_loss

    t = Tensor(
        "w",
        "head+table",
        100,
        [
            Option(4, 32, 10, 0.02),
            Option(4, 32, 12, 1e-9, float_zero=True),
            Option(4, 32, 14, 0.005, frequent_rows=8, frequent_group=32),
        ],
    )
    factors = _apply_loss([t], ({"w": "head"}, {"head": {"kl": 0.1, "weights": 1}}))
    assert factors["w"] == pytest.approx(0.1 / 0.02)
