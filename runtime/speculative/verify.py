"""Decide which draft tokens the target model agrees with.

The verifier never learns which proposer drafted: it sees the drafts, optional draft
distributions and the target's scores at the K+1 positions (after each of the K drafts
prefixes, plus one past the last draft). Per row it returns

* **accepted** tokens: the longest prefix of the drafts that passed verification
  (``VerifyResult.accepted[b]`` of them);
* then exactly one extra token, which is either
  * a **recovered** token, drawn at the first rejected position in place of the rejected draft
    (greedy: the target's argmax; sampling: a draw from ``norm(max(0, p - q))``), or
  * a **bonus** token, drawn from the target at position ``lengths[b]`` when every draft was
    accepted (a free token: the target scored that position anyway).

So a row always gains ``accepted[b] + 1`` tokens, and with a target that is exactly the
distribution the sampler would use, the output distribution equals plain sampling from the
target (Leviathan et al. 2023; Chen et al. 2023).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from specport.errors import InputError
from specport.runtime.sampler import sample_from_probs
from specport.runtime.speculative.base import Drafts

logger = logging.getLogger(__name__)


@dataclass
class VerifyResult:
    """Per row: how many drafts were accepted, and the tokens to append."""

    accepted: np.ndarray  # [B] int64: drafts accepted (prefix length)
    tokens: list[list[int]]  # per row: accepted drafts + one recovered or bonus token
    bonus: np.ndarray  # [B] bool: True when the extra token is a bonus (all drafts accepted)

    @property
    def num_emitted(self) -> np.ndarray:  # [B]
        return self.accepted + 1


def _check(drafts: Drafts, target: np.ndarray, what: str) -> None:
    if target.ndim != 3 or target.shape[0] != drafts.batch_size:
        raise InputError(
            f"{what} must be [B={drafts.batch_size}, K+1, V], got {list(target.shape)}"
        )
    if target.shape[1] < drafts.width + 1:
        raise InputError(
            f"{what} cover {target.shape[1]} positions but {drafts.width} drafts need "
            f"{drafts.width + 1} (one per draft plus the bonus position)"
        )


def _valid(drafts: Drafts) -> np.ndarray:  # [B, K] bool: slot holds a real draft
    return np.arange(drafts.width)[None, :] < drafts.lengths[:, None]


def _assemble(drafts: Drafts, accepted: np.ndarray, extra: np.ndarray) -> VerifyResult:
    tokens = [[*drafts.tokens[b, : accepted[b]].tolist(), int(extra[b])] for b in range(len(extra))]
    return VerifyResult(accepted.astype(np.int64), tokens, accepted == drafts.lengths)


def greedy_verify(
    drafts: Drafts,
    target_logits: np.ndarray,  # [B, K+1, V]
) -> VerifyResult:
    """Exact greedy: accept drafts while they equal the target's argmax."""
    target_logits = np.asarray(target_logits)
    _check(drafts, target_logits, "target_logits")
    k = drafts.width
    best = np.argmax(target_logits[:, : k + 1], axis=-1)  # [B, K+1]
    match = (drafts.tokens == best[:, :k]) & _valid(drafts)
    accepted = np.cumprod(match, axis=1).sum(axis=1)
    extra = best[np.arange(drafts.batch_size), accepted]
    return _assemble(drafts, accepted, extra)


def rejection_verify(
    drafts: Drafts,
    target_probs: np.ndarray,  # [B, K+1, V] the distribution the sampler would draw from
    rng: np.random.Generator,
    draft_probs: np.ndarray | None = None,  # [B, K, V]; None -> drafts.probs
) -> VerifyResult:
    """Lossless speculative sampling.

    Draft x at position i is accepted with probability ``min(1, p_i(x) / q_i(x))``; at the
    first rejection the recovered token is drawn from ``norm(max(0, p_i - q_i))``; if all are
    accepted the bonus token is drawn from ``p_K``. Without draft probabilities (an n-gram or
    other deterministic proposer) q is one-hot at x, so x is accepted with probability
    ``p_i(x)`` and the recovered token comes from p_i with x removed.

    RNG use is fixed per call (B*K uniforms, then B), so a seeded ``rng`` is reproducible.
    """
    target_probs = np.asarray(target_probs, dtype=np.float64)
    _check(drafts, target_probs, "target_probs")
    q = draft_probs if draft_probs is not None else drafts.probs
    n_rows, k = drafts.batch_size, drafts.width
    rows = np.arange(n_rows)
    tok = np.maximum(drafts.tokens, 0)[..., None]  # [B, K, 1]
    p_x = np.take_along_axis(target_probs[:, :k], tok, axis=-1)[..., 0]
    if q is not None:
        q = np.asarray(q, dtype=np.float64)
        if q.shape[:2] != (n_rows, k) or q.shape[2] != target_probs.shape[2]:
            raise InputError(
                f"draft_probs must be [B, K, V]={[n_rows, k]}+[V], got {list(q.shape)}"
            )
        q_x = np.take_along_axis(q, tok, axis=-1)[..., 0]
    else:
        q_x = np.ones_like(p_x)

    u = rng.random((n_rows, k))
    ok = (u * q_x < p_x) & _valid(drafts)
    accepted = np.cumprod(ok, axis=1).sum(axis=1)

    rejected = np.flatnonzero(accepted < drafts.lengths)
    dist = target_probs[rows, accepted]  # [B, V]: p at the extra token's position (a copy)
    if rejected.size:
        at = accepted[rejected]
        if q is not None:
            residual = np.maximum(dist[rejected] - q[rejected, at], 0.0)
        else:
            residual = dist[rejected].copy()
            residual[np.arange(rejected.size), drafts.tokens[rejected, at]] = 0.0
        # p == q up to rounding: rejection had probability ~0, keep sampling from p
        usable = residual.sum(axis=-1) > 0
        dist[rejected[usable]] = residual[usable]
    extra = sample_from_probs(dist, rng)
    return _assemble(drafts, accepted, extra)
