"""Verifiers: exact greedy acceptance, and rejection sampling that preserves the target."""

from __future__ import annotations

import numpy as np
import pytest

from specport.core.errors import InputError
from specport.runtime.speculative.base import Drafts
from specport.runtime.speculative.verify import greedy_verify, rejection_verify

V = 5


def _logits_with_argmax(argmax: list[list[int]], vocab: int = 10) -> np.ndarray:
    """[B, K+1, V] logits whose argmax at each position is given."""
    rng = np.random.default_rng(0)
    out = rng.standard_normal((len(argmax), len(argmax[0]), vocab)).astype(np.float32)
    for b, row in enumerate(argmax):
        for i, t in enumerate(row):
            out[b, i, t] = 10.0
    return out


def test_greedy_all_partial_first_reject():
    target = _logits_with_argmax([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]])
    drafts = Drafts.from_lists([[1, 2, 3], [1, 2, 7], [9, 2, 3]])
    res = greedy_verify(drafts, target)
    assert res.accepted.tolist() == [3, 2, 0]
    assert res.tokens == [[1, 2, 3, 4], [1, 2, 3], [1]]
    assert res.bonus.tolist() == [True, False, False]
    assert res.num_emitted.tolist() == [4, 3, 1]


def test_greedy_ragged_lengths_and_empty():
    target = _logits_with_argmax([[5, 6, 7], [5, 6, 7]])
    drafts = Drafts.from_lists([[5], [5, 6]])  # row 0 padded: bonus from position 1
    res = greedy_verify(drafts, target)
    assert res.tokens == [[5, 6], [5, 6, 7]]
    res = greedy_verify(Drafts.empty(2), target[:, :1])
    assert res.accepted.tolist() == [0, 0] and res.tokens == [[5], [5]]


def test_rejection_with_one_hot_target_equals_greedy():
    """A greedy target (one-hot p) makes rejection sampling exactly greedy verification."""
    argmax = [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]]
    p = np.zeros((3, 4, 10))
    for b, row in enumerate(argmax):
        p[b, np.arange(4), row] = 1.0
    drafts = Drafts.from_lists([[1, 2, 3], [1, 2, 7], [9, 2, 3]])
    ref = greedy_verify(drafts, _logits_with_argmax(argmax))
    for seed in range(5):
        for q in (None, Drafts.make_dummy(3, 3, 10, seed=seed).probs):
            res = rejection_verify(drafts, p, np.random.default_rng(seed), q)
            assert res.tokens == ref.tokens


def _first_token_frequencies(
    p: np.ndarray, q: np.ndarray | None, trials: int, seed: int
) -> np.ndarray:
    """Empirical distribution of the first emitted token, drafts drawn from q (or fixed)."""
    rng = np.random.default_rng(seed)
    k = 2
    target = np.broadcast_to(p, (trials, k + 1, V)).copy()
    if q is None:
        tokens = np.full((trials, k), 3, dtype=np.int64)  # deterministic (n-gram-like) draft
        draft_probs = None
    else:
        tokens = np.stack([rng.choice(V, size=trials, p=q[i]) for i in range(k)], axis=1)
        draft_probs = np.broadcast_to(q, (trials, k, V)).copy()
    drafts = Drafts(tokens, np.full(trials, k))
    res = rejection_verify(drafts, target, rng, draft_probs)
    first = np.array([row[0] for row in res.tokens])
    return np.bincount(first, minlength=V) / trials


def _chi2(freq: np.ndarray, p: np.ndarray, n: int) -> float:
    support = p > 0
    assert np.all(freq[~support] == 0)
    return float(np.sum((freq[support] - p[support]) ** 2 / p[support]) * n)


P = np.array([0.1, 0.4, 0.05, 0.25, 0.2])
Q = np.array([0.3, 0.1, 0.3, 0.1, 0.2])


@pytest.mark.parametrize("with_q", [True, False])
def test_rejection_preserves_target_distribution(with_q: bool):
    n = 200_000
    q = np.stack([Q, Q[::-1]]) if with_q else None
    freq = _first_token_frequencies(P, q, n, seed=11)
    # 0.999 quantile of chi-square with 4 dof is 18.47
    assert _chi2(freq, P, n) < 18.47, freq


def test_rejection_second_token_also_follows_target():
    """Position 2 given position 1: with per-position p, the pair distribution is p1 x p2."""
    rng = np.random.default_rng(3)
    n = 100_000
    p = np.stack([P, np.array([0.3, 0.3, 0.2, 0.1, 0.1]), P[::-1]])
    q = np.stack([Q, Q[::-1]])
    tokens = np.stack([rng.choice(V, size=n, p=q[i]) for i in range(2)], axis=1)
    res = rejection_verify(
        Drafts(tokens, np.full(n, 2)),
        np.broadcast_to(p, (n, 3, V)).copy(),
        rng,
        np.broadcast_to(q, (n, 2, V)).copy(),
    )
    # Every row emits >= 1 token; rows emitting >= 2 give a draw of token 2 independent of token 1
    second = np.array([row[1] for row in res.tokens if len(row) >= 2])
    freq = np.bincount(second, minlength=V) / len(second)
    assert _chi2(freq, p[1], len(second)) < 18.47, freq


def test_acceptance_rate_matches_theory():
    """P(accept first draft) = sum_x min(p(x), q(x)) when the draft is drawn from q."""
    n = 100_000
    rng = np.random.default_rng(5)
    tokens = rng.choice(V, size=(n, 1), p=Q)
    res = rejection_verify(
        Drafts(tokens, np.ones(n)),
        np.broadcast_to(P, (n, 2, V)).copy(),
        rng,
        np.broadcast_to(Q, (n, 1, V)).copy(),
    )
    expected = np.minimum(P, Q).sum()
    rate = res.accepted.mean()
    assert abs(rate - expected) < 4 * np.sqrt(expected * (1 - expected) / n)


def test_rejection_seeded_determinism():
    drafts = Drafts.make_dummy(4, 3, 7, seed=1)
    p = Drafts.make_dummy(4, 4, 7, seed=2).probs
    a = rejection_verify(drafts, p, np.random.default_rng(42))
    b = rejection_verify(drafts, p, np.random.default_rng(42))
    assert a.tokens == b.tokens and a.accepted.tolist() == b.accepted.tolist()


def test_shape_errors():
    drafts = Drafts.from_lists([[1, 2]])
    with pytest.raises(InputError, match="bonus position"):
        greedy_verify(drafts, np.zeros((1, 2, 5)))
    with pytest.raises(InputError):
        rejection_verify(drafts, np.zeros((1, 3, 5)), np.random.default_rng(0), np.zeros((1, 2, 4)))
