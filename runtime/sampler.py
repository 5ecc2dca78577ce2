"""Turn logits into token ids: greedy, or sampling with the usual filters.

The sampler is a pure function of (logits, history, settings, its own RNG), numpy only, because
it runs once per decode step on the host and must cost far less than the model step. Two
details matter for that:

* top-k uses ``np.argpartition`` (O(V)), never a full sort of the vocabulary;
* top-p sorts only a growing candidate set (the 64, 256, 1024, ... most likely tokens, picked
  with ``argpartition``) until the candidates hold at least ``top_p`` of the mass, which for
  real LM distributions almost always stops at the first size.

Order of the filters follows Hugging Face ``generate``: repetition penalty, temperature,
top-k, top-p, min-p. OpenAI's presence / frequency penalties and logit bias are added to the
logits with the repetition penalty (as vLLM applies them, before temperature). ``Sampler.probs`` returns the processed distribution that ``__call__``
samples from; speculative rejection sampling needs exactly that distribution as its target.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from specport.core.errors import InputError

logger = logging.getLogger(__name__)

_TOP_P_CANDIDATES = 64  # first candidate-set size for top-p; grows x8 until the mass is reached


@dataclass(frozen=True)
class SamplingConfig:
    """Decoding settings. ``greedy`` ignores temperature/top-k/top-p/min-p (not the penalty)."""

    greedy: bool = True
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    min_p: float = 0.0  # 0.0 = off
    repetition_penalty: float = 1.0  # 1.0 = off (HF semantics: >1 discourages repeats)
    seed: int | None = None
    presence_penalty: float = 0.0  # OpenAI: minus this once for every token already generated
    frequency_penalty: float = 0.0  # OpenAI: minus this times the token's count so far
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    # a structured-output grammar (runtime/grammar.Constraint): masks the logits, then follows
    # the chosen token; stateful, so one per request (batch of one row)
    constraint: Any = field(default=None, compare=False, repr=False)

    @property
    def needs_history(self) -> bool:
        """True when a token's score depends on the tokens before it (a penalty is on)."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def plain(self) -> bool:
        """True when the logits go to the sampler unchanged (no penalty, bias or grammar)."""
        return not self.needs_history and not self.logit_bias and self.constraint is None

    def validate(self) -> SamplingConfig:
        """Raise `InputError` on settings that cannot be sampled with; return self otherwise."""
        if not self.greedy and not (np.isfinite(self.temperature) and self.temperature > 0):
            raise InputError(
                f"temperature must be a positive number when sampling, got {self.temperature}; "
                "use greedy decoding (greedy=True / --greedy) for deterministic output"
            )
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, (int, np.integer)):
            raise InputError(f"top_k must be an integer (0 turns it off), got {self.top_k!r}")
        if self.top_k < 0:
            raise InputError(f"top_k must be >= 0 (0 turns it off), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise InputError(f"top_p must be in (0, 1] (1.0 turns it off), got {self.top_p}")
        if not (0.0 <= self.min_p <= 1.0):
            raise InputError(f"min_p must be in [0, 1] (0 turns it off), got {self.min_p}")
        if not (np.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise InputError(
                "repetition_penalty must be a positive number (1.0 turns it off), "
                f"got {self.repetition_penalty}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not np.isfinite(value):
                raise InputError(f"{name} must be a finite number (0 turns it off), got {value}")
        if any(not np.isfinite(b) for _, b in self.logit_bias):
            raise InputError("logit_bias values must be finite numbers")
        if self.seed is not None and (
            isinstance(self.seed, bool)
            or not isinstance(self.seed, (int, np.integer))
            or self.seed < 0
        ):
            raise InputError(f"seed must be a non-negative integer or None, got {self.seed!r}")
        return self


class Sampler:
    """Stateful only in its RNG: same config + seed + inputs gives the same tokens."""

    def __init__(self, config: SamplingConfig, vocab_size: int) -> None:
        self.config = config.validate()
        if vocab_size <= 0:
            raise InputError(f"vocab_size must be positive, got {vocab_size}")
        self.vocab_size = int(vocab_size)
        self.rng = np.random.default_rng(config.seed)

    # ------------------------------------------------------------------ public API

    def __call__(
        self,
        logits: np.ndarray,  # [B, V] float32
        history: list[np.ndarray] | None = None,  # B arrays of previous token ids
        generated: list[np.ndarray] | None = None,  # B arrays of new ids (default: history)
    ) -> np.ndarray:  # [B] int64
        """Pick one token per row."""
        scores = self._penalized(logits, history, generated)
        constraint = self.config.constraint
        if constraint is not None:
            scores = constraint.mask(scores)
        if self.config.greedy:
            ids = np.argmax(scores, axis=-1).astype(np.int64)
        else:
            cand, probs = self._filtered(scores)
            if cand is None:
                ids = sample_from_probs(probs, self.rng)
            else:
                picked = sample_from_probs(probs, self.rng)
                ids = cand[np.arange(cand.shape[0]), picked].astype(np.int64)
        if constraint is not None:
            constraint.accept(int(ids[0]))
        return ids

    def probs(
        self,
        logits: np.ndarray,  # [B, V] or [B, T, V] float32
        history: list[np.ndarray] | None = None,
    ) -> np.ndarray:  # same shape as logits, float64, rows sum to 1
        """The processed distribution `__call__` samples from (one-hot at the argmax if greedy).

        For 3-D logits (speculative verification, [B, K+1, V]) ``history`` may hold B arrays
        (applied to every position of a row) or B*T arrays (one per position, exact when a
        repetition penalty is on and the draft tokens should count as history).
        """
        logits = np.asarray(logits)
        if logits.ndim == 3:
            b, t, v = logits.shape
            if history is not None and len(history) == b and t != 1:
                history = [h for h in history for _ in range(t)]
            return self.probs(logits.reshape(b * t, v), history).reshape(b, t, v)
        scores = self._penalized(logits, history)
        n_rows = scores.shape[0]
        if self.config.greedy:
            out = np.zeros(scores.shape, dtype=np.float64)
            out[np.arange(n_rows), np.argmax(scores, axis=-1)] = 1.0
            return out
        cand, probs = self._filtered(scores)
        if cand is None:
            return probs
        out = np.zeros(scores.shape, dtype=np.float64)
        out[np.arange(n_rows)[:, None], cand] = probs
        return out

    def scores(
        self, logits: np.ndarray, history: list[np.ndarray] | None = None
    ) -> np.ndarray:  # [B, V] float32
        """The logits after the penalties and the logit bias, before a grammar's mask and the
        temperature: what greedy decoding takes the argmax of (speculative verification under
        a grammar masks these itself, position by position)."""
        return self._penalized(np.asarray(logits), history)

    # ------------------------------------------------------------------ steps

    def _check(self, logits: np.ndarray, history: list[np.ndarray] | None) -> None:
        if logits.ndim != 2 or logits.shape[1] != self.vocab_size:
            raise InputError(
                f"logits must have shape [batch, {self.vocab_size}], got {list(logits.shape)}; "
                "pass the last position's logits (logits[:, -1, :])"
            )
        if history is not None and len(history) != logits.shape[0]:
            raise InputError(
                f"history has {len(history)} rows but logits have {logits.shape[0]}; "
                "pass one array of previous token ids per row"
            )

    def _penalized(
        self,
        logits: np.ndarray,
        history: list[np.ndarray] | None,
        generated: list[np.ndarray] | None = None,
    ) -> np.ndarray:
        """The logits (float32) with the HF repetition penalty (over `history`), OpenAI's
        presence / frequency penalties (over `generated`, the new tokens only, as OpenAI and
        vLLM count them; `history` when not given) and the logit bias (copied only if needed)."""
        logits = np.asarray(logits)
        self._check(logits, history)
        scores = logits if logits.dtype == np.float32 else logits.astype(np.float32)
        cfg = self.config
        if generated is None:
            generated = history
        if cfg.plain or (history is None and generated is None and not cfg.logit_bias):
            return scores
        scores = scores.copy()
        if cfg.logit_bias:
            ids = np.fromiter((t for t, _ in cfg.logit_bias), dtype=np.int64)
            scores[:, ids] += np.fromiter((b for _, b in cfg.logit_bias), dtype=np.float32)
        penalty = cfg.repetition_penalty
        for row, ids in enumerate(history if penalty != 1.0 and history is not None else []):
            ids = np.unique(np.asarray(ids, dtype=np.int64).ravel())
            ids = ids[(ids >= 0) & (ids < self.vocab_size)]
            if ids.size == 0:
                continue
            s = scores[row, ids]
            scores[row, ids] = np.where(s < 0, s * penalty, s / penalty)
        if not (cfg.presence_penalty or cfg.frequency_penalty) or generated is None:
            return scores
        for row, ids in enumerate(generated):
            ids, counts = np.unique(np.asarray(ids, dtype=np.int64).ravel(), return_counts=True)
            keep = (ids >= 0) & (ids < self.vocab_size)
            ids, counts = ids[keep], counts[keep].astype(np.float32)
            scores[row, ids] -= (
                np.float32(cfg.presence_penalty) + np.float32(cfg.frequency_penalty) * counts
            )
        return scores

    def _filtered(
        self,
        scores: np.ndarray,  # [B, V] float32
    ) -> tuple[np.ndarray | None, np.ndarray]:
        """Apply temperature, top-k, top-p, min-p.

        Returns ``(ids [B, C], probs [B, C])`` when a filter left a candidate set (sampling
        then costs O(C)), or ``(None, probs [B, V])`` for the full distribution. Probabilities
        are float64 and rows sum to 1. Top-k and top-p select on the logits directly, since
        a positive temperature does not change their order.
        """
        cfg = self.config
        n_rows, vocab = scores.shape
        rows = np.arange(n_rows)[:, None]
        inv_t = 1.0 / cfg.temperature
        cand: np.ndarray | None = None

        if 0 < cfg.top_k < vocab:
            cand = np.argpartition(scores, vocab - cfg.top_k, axis=-1)[:, vocab - cfg.top_k :]
            probs = _softmax(scores[rows, cand].astype(np.float64) * inv_t)
            if cfg.top_p < 1.0:
                order = np.argsort(-probs, axis=-1, kind="stable")
                cand = np.take_along_axis(cand, order, axis=-1)
                probs = _truncate_sorted(np.take_along_axis(probs, order, axis=-1), cfg.top_p)
        elif cfg.top_p < 1.0:
            cand, probs = _top_p_candidates(scores, inv_t, cfg.top_p)
        else:
            probs = _softmax(scores, inv_t)

        if cfg.min_p > 0.0:
            threshold = cfg.min_p * probs.max(axis=-1, keepdims=True)
            probs = np.where(probs >= threshold, probs, 0.0)
        if cand is not None or cfg.min_p > 0.0:
            probs /= probs.sum(axis=-1, keepdims=True)
        return cand, probs


# ---------------------------------------------------------------------- helpers


def _softmax(x: np.ndarray, scale: float = 1.0) -> np.ndarray:
    """Row softmax of ``x * scale`` as float64 (exp in x's dtype); -inf entries get 0."""
    m = np.max(x, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    e = np.exp((x - m) * np.asarray(scale, dtype=x.dtype))
    z = e.sum(axis=-1, keepdims=True, dtype=np.float64)
    return e / z


def _truncate_sorted(sorted_probs: np.ndarray, top_p: float) -> np.ndarray:
    """Zero the tail of descending-sorted rows: keep tokens whose preceding mass is < top_p.

    This is Hugging Face's rule (drop tokens whose ascending cumulative mass is <= 1 - top_p)
    written from the top: the smallest prefix holding at least ``top_p`` survives, and the most
    likely token always does.
    """
    before = np.cumsum(sorted_probs, axis=-1) - sorted_probs
    return np.where(before < top_p, sorted_probs, 0.0)


def _top_p_candidates(
    scores: np.ndarray,  # [B, V] float32 logits
    inv_t: float,
    top_p: float,
) -> tuple[np.ndarray, np.ndarray]:  # ids [B, C], probs [B, C] (sorted desc, tail zeroed)
    """Nucleus candidates by partial selection: grow C until every row reaches ``top_p``.

    One O(V) pass computes each row's normalizer; candidates are then picked with
    ``argpartition`` on the logits and only they are sorted.
    """
    n_rows, vocab = scores.shape
    m = scores.max(axis=-1, keepdims=True).astype(np.float64)
    z = np.exp((scores - m.astype(scores.dtype)) * np.float32(inv_t)).sum(
        axis=-1, keepdims=True, dtype=np.float64
    )
    c = min(_TOP_P_CANDIDATES, vocab)
    while True:
        if c < vocab:
            cand = np.argpartition(scores, vocab - c, axis=-1)[:, vocab - c :]
        else:
            cand = np.broadcast_to(np.arange(vocab), (n_rows, vocab))
        cand_scores = np.take_along_axis(scores, cand, axis=-1).astype(np.float64)
        order = np.argsort(-cand_scores, axis=-1, kind="stable")
        cand = np.take_along_axis(cand, order, axis=-1)
        probs = np.exp((np.take_along_axis(cand_scores, order, axis=-1) - m) * inv_t) / z
        if c == vocab or np.all(probs.sum(axis=-1) >= top_p):
            return cand, _truncate_sorted(probs, top_p)
        c = min(c * 8, vocab) if c * 8 < vocab // 2 else vocab


_BLOCK = 1024  # sampling block: a cumsum over V is replaced by one over V/_BLOCK + _BLOCK


def sample_from_probs(
    probs: np.ndarray,  # [B, N] non-negative, rows need not be normalized
    rng: np.random.Generator,
) -> np.ndarray:  # [B] int64, indices into the last axis
    """Inverse-CDF sampling, one uniform per row (reproducible for a seeded ``rng``).

    Two-level for long rows: pick a block of ``_BLOCK`` entries by the block masses, then the
    entry inside it, so no full-length float64 cumsum is needed.
    """
    probs = np.asarray(probs)
    n_rows, n = probs.shape
    u = np.asarray(rng.random((n_rows,)), dtype=np.float64)
    if n <= _BLOCK:  # short rows (candidate sets, small vocabularies): one vectorized pass
        cdf = np.cumsum(probs, axis=-1, dtype=np.float64)
        ids = np.sum(cdf <= (u * cdf[:, -1])[:, None], axis=-1)
        return np.minimum(ids, n - 1).astype(np.int64)
    out = np.empty(n_rows, dtype=np.int64)
    starts = np.arange(0, n, _BLOCK)
    for row in range(n_rows):
        p = probs[row]
        block_cdf = np.cumsum(np.add.reduceat(p, starts, dtype=np.float64))
        target = u[row] * block_cdf[-1]
        blk = min(int(np.searchsorted(block_cdf, target, side="right")), len(starts) - 1)
        lo = int(starts[blk])
        inner = np.cumsum(p[lo : lo + _BLOCK], dtype=np.float64)
        rest = target - (block_cdf[blk - 1] if blk else 0.0)
        idx = int(np.searchsorted(inner, rest, side="right"))
        if idx >= inner.shape[0] or p[lo + idx] <= 0:  # rounding at a block edge
            nonzero = np.flatnonzero(p[lo : lo + _BLOCK])
            idx = int(nonzero[-1]) if nonzero.size else int(np.argmax(p))
            lo = lo if nonzero.size else 0
        out[row] = lo + idx
    return out
