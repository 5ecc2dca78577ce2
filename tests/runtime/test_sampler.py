"""Sampler: filters keep exactly the reference token sets, sampling follows `probs`."""

from __future__ import annotations

import numpy as np
import pytest

from specport.core.errors import InputError
from specport.runtime.sampler import Sampler, SamplingConfig, sample_from_probs


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _reference_keep(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> list[set]:
    """Full-sort reference (HF semantics) of the token set each row may sample."""
    out = []
    for row in logits.astype(np.float64) / temperature:
        order = np.argsort(-row, kind="stable")
        if top_k:
            order = order[:top_k]
        p = _softmax(row[order])
        cum = np.cumsum(p)
        # HF: remove tokens whose ascending cumulative mass <= 1 - top_p (keep at least one).
        asc_cum = np.cumsum(p[::-1])[::-1]  # mass of this token and everything below it
        keep = asc_cum > 1 - top_p
        keep[0] = True
        del cum
        out.append({int(t) for t, k in zip(order, keep) if k})
    return out


@pytest.mark.parametrize(
    ("vocab", "top_k", "top_p", "temperature"),
    [
        (1000, 10, 1.0, 1.0),
        (1000, 0, 0.9, 1.0),
        (5000, 0, 0.95, 0.3),  # peaked: candidate set stops at 64
        (5000, 0, 0.99, 3.0),  # flat: candidate set has to grow past 64
        (3000, 200, 0.8, 2.0),
        (50, 0, 0.5, 1.0),  # vocab smaller than the first candidate size
    ],
)
def test_filters_keep_reference_set(vocab: int, top_k: int, top_p: float, temperature: float):
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((6, vocab)) * 3).astype(np.float32)
    cfg = SamplingConfig(greedy=False, temperature=temperature, top_k=top_k, top_p=top_p)
    probs = Sampler(cfg, vocab).probs(logits)
    ref = _reference_keep(logits, temperature, top_k, top_p)
    for row in range(logits.shape[0]):
        assert set(np.flatnonzero(probs[row]).tolist()) == ref[row]
    np.testing.assert_allclose(probs.sum(axis=-1), 1.0, rtol=1e-9)
    # Kept tokens keep their relative weights.
    scaled = logits.astype(np.float64) / temperature
    for row in range(logits.shape[0]):
        kept = np.flatnonzero(probs[row])
        np.testing.assert_allclose(probs[row, kept], _softmax(scaled[row, kept]), rtol=1e-5)


def test_min_p_keeps_tokens_above_fraction_of_max():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((4, 300)).astype(np.float32) * 2
    probs = Sampler(SamplingConfig(greedy=False, min_p=0.1), 300).probs(logits)
    full = _softmax(logits.astype(np.float64))
    for row in range(4):
        expected = set(np.flatnonzero(full[row] >= 0.1 * full[row].max()).tolist())
        assert set(np.flatnonzero(probs[row]).tolist()) == expected


def test_greedy_is_argmax_and_probs_one_hot():
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((5, 777)).astype(np.float32)
    sampler = Sampler(SamplingConfig(), 777)
    ids = sampler(logits)
    assert ids.dtype == np.int64 and ids.shape == (5,)
    np.testing.assert_array_equal(ids, logits.argmax(-1))
    probs = sampler.probs(logits)
    np.testing.assert_array_equal(probs.argmax(-1), ids)
    np.testing.assert_array_equal(probs.sum(-1), 1.0)


def test_repetition_penalty_hf_semantics():
    logits = np.array([[2.0, -2.0, 1.0, 0.5]], dtype=np.float32)
    sampler = Sampler(SamplingConfig(repetition_penalty=2.0), 4)
    scores = sampler._penalized(logits, [np.array([0, 1, 1])])
    np.testing.assert_allclose(scores, [[1.0, -4.0, 1.0, 0.5]])
    # Greedy honours it too: token 0 no longer wins outright (tie with 2 -> first index).
    logits2 = np.array([[2.0, 0.0, 1.5, 0.0]], dtype=np.float32)
    assert sampler(logits2, [np.array([0])])[0] == 2


def test_seeded_reproducibility():
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((3, 400)).astype(np.float32)
    cfg = SamplingConfig(greedy=False, temperature=0.8, top_p=0.9, seed=1234)
    a, b = Sampler(cfg, 400), Sampler(cfg, 400)
    seq_a = [a(logits) for _ in range(20)]
    seq_b = [b(logits) for _ in range(20)]
    np.testing.assert_array_equal(np.stack(seq_a), np.stack(seq_b))
    c = Sampler(SamplingConfig(greedy=False, temperature=0.8, top_p=0.9, seed=99), 400)
    assert not np.array_equal(np.stack(seq_a), np.stack([c(logits) for _ in range(20)]))


def test_sampling_frequencies_match_processed_distribution():
    """Pearson chi-square of 40k draws against `probs` stays below the 0.999 quantile."""
    logits = np.array([[1.0, 0.5, 0.0, -0.5, 2.0, 1.5, -3.0, 0.2]], dtype=np.float32)
    cfg = SamplingConfig(greedy=False, temperature=0.9, top_k=6, top_p=0.95, seed=7)
    sampler = Sampler(cfg, 8)
    p = sampler.probs(logits)[0]
    n = 40_000
    batch = np.repeat(logits, n, axis=0)
    counts = np.bincount(sampler(batch), minlength=8)
    assert np.all(counts[p == 0] == 0)
    support = p > 0
    expected = n * p[support]
    chi2 = float(np.sum((counts[support] - expected) ** 2 / expected))
    dof = int(support.sum()) - 1
    assert dof >= 3
    # 0.999 quantiles of chi-square: dof 3 -> 16.27, 4 -> 18.47, 5 -> 20.52
    assert chi2 < {3: 16.27, 4: 18.47, 5: 20.52}[dof], (chi2, counts, expected)


def test_sample_from_probs_skips_zero_mass():
    rng = np.random.default_rng(0)
    probs = np.array([[0.0, 0.5, 0.0, 0.5, 0.0]] * 1000)
    ids = sample_from_probs(probs, rng)
    assert set(ids.tolist()) == {1, 3}


def test_probs_3d_shape_and_history_broadcast():
    rng = np.random.default_rng(4)
    logits = rng.standard_normal((2, 3, 50)).astype(np.float32)
    sampler = Sampler(SamplingConfig(greedy=False, repetition_penalty=1.3), 50)
    hist = [np.array([1, 2]), np.array([3])]
    p3 = sampler.probs(logits, hist)
    assert p3.shape == (2, 3, 50)
    np.testing.assert_allclose(p3[1, 2], sampler.probs(logits[1:2, 2], [hist[1]])[0])


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"greedy": False, "temperature": 0.0}, "temperature"),
        ({"greedy": False, "temperature": -1.0}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"seed": -3}, "seed"),
    ],
)
def test_config_validation(kwargs: dict, needle: str):
    with pytest.raises(InputError, match=needle):
        SamplingConfig(**kwargs).validate()
    with pytest.raises(InputError):
        Sampler(SamplingConfig(**kwargs), 10)


def test_greedy_allows_zero_temperature():
    SamplingConfig(greedy=True, temperature=0.0).validate()


def test_bad_logits_shape():
    with pytest.raises(InputError, match="shape"):
        Sampler(SamplingConfig(), 10)(np.zeros((2, 11), dtype=np.float32))


def test_sample_from_probs_across_blocks():
    """Two-level sampling on a long row: mass on block edges is drawn at the right rates."""
    rng = np.random.default_rng(5)
    probs = np.zeros((1, 5000))
    ids = [3, 1023, 1024, 2047, 4999]
    probs[0, ids] = [0.1, 0.2, 0.3, 0.15, 0.25]
    n = 20_000
    draws = np.concatenate(
        [sample_from_probs(np.repeat(probs, 1000, axis=0), rng) for _ in range(20)]
    )
    counts = np.bincount(draws, minlength=5000)
    assert counts.sum() == n and counts[ids].sum() == n
    expected = n * probs[0, ids]
    chi2 = float(np.sum((counts[ids] - expected) ** 2 / expected))
    assert chi2 < 18.47  # chi-square 0.999 quantile, 4 dof


@pytest.mark.slow  # imports torch + transformers (~6 s cold)
@pytest.mark.parametrize(
    "cfg",
    [
        SamplingConfig(greedy=False, temperature=0.7, top_k=20),
        SamplingConfig(greedy=False, temperature=1.3, top_p=0.85),
        SamplingConfig(greedy=False, temperature=0.9, top_k=100, top_p=0.9, min_p=0.02),
        SamplingConfig(greedy=False, min_p=0.05, repetition_penalty=1.3),
    ],
)
def test_probs_match_hugging_face_processors(cfg: SamplingConfig):
    """Same distribution as transformers' logits processors, applied in generate()'s order."""
    torch = pytest.importorskip("torch")
    lp = pytest.importorskip("transformers.generation.logits_process")
    rng = np.random.default_rng(6)
    vocab = 2000
    logits = (rng.standard_normal((3, vocab)) * 3).astype(np.float32)
    history = [rng.integers(0, vocab, size=30) for _ in range(3)]
    procs = []
    if cfg.repetition_penalty != 1.0:
        procs.append(lp.RepetitionPenaltyLogitsProcessor(cfg.repetition_penalty))
    procs.append(lp.TemperatureLogitsWarper(cfg.temperature))
    if cfg.top_k:
        procs.append(lp.TopKLogitsWarper(cfg.top_k))
    if cfg.top_p < 1.0:
        procs.append(lp.TopPLogitsWarper(cfg.top_p))
    if cfg.min_p:
        procs.append(lp.MinPLogitsWarper(cfg.min_p))
    scores = torch.from_numpy(logits.copy())
    ids = torch.from_numpy(np.stack(history))
    for proc in procs:
        scores = proc(ids, scores)
    ref = torch.softmax(scores.double(), dim=-1).numpy()
    ours = Sampler(cfg, vocab).probs(logits, history)
    np.testing.assert_array_equal(ours > 0, ref > 0)
    np.testing.assert_allclose(ours, ref, atol=1e-6)
