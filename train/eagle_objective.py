"""The EAGLE head's training objective: the training-time test over chained drafts.

Kept apart from the head (``exporter.eagle_head``, the module the exporter writes as the draft
graph) because it is training only: ``ttt_loss`` runs the head's own pieces (``qkv``,
``expand_kv``, ``finish``, ``logits``) the way inference chains drafts, over a whole training
sequence at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from specport.exporter.eagle_head import EagleHead


@dataclass
class TTTResult:
    """What ``ttt_loss`` computed over a batch."""

    loss: torch.Tensor  # mean cross-entropy over the depths
    stats: list[tuple[int, int]]  # (right, counted) per depth
    right: torch.Tensor  # [depth, B, T] bool: depth j's draft at position t was the choice
    counted: torch.Tensor  # [depth, B, T] bool: position t has a label at depth j


def ttt_loss(
    head: EagleHead,
    features: torch.Tensor,  # [B, T, 3H]
    next_ids: torch.Tensor,  # [B, T] the token at t+1
    labels: torch.Tensor,  # [B, T] draft-vocab index of the target's choice at t+1;
    # -1: no label here, -2: the target chose a token outside the draft vocabulary
    depth: int,
    soft: tuple[torch.Tensor, torch.Tensor] | None = None,  # [B, T, K] draft indices
    # of the target's top-K choices after t+1 (-1: outside the draft vocabulary), probs
) -> TTTResult:
    """Mean cross-entropy over ``depth`` chained drafts, and which drafts were right.

    Depth j at position t continues from origin o = t - j: its input is the head's depth
    j-1 output at t-1 (depth 0: the target's features at t), it attends to depth-0 keys at
    positions <= o and to its own depth-i keys at o + i (i = 1..j), exactly the KV an
    inference draft from o sees. Its label is the target's choice after t+1: the
    cross-entropy is against that choice, or with ``soft`` against the target's top-K
    distribution renormalised over the draft vocabulary (the EAGLE-3 objective, cut to
    the K tokens that hold most of the mass). Hits count against the choice either way."""
    t = next_ids.shape[1]
    pos = torch.arange(t)
    scale = 1.0 / math.sqrt(head.cfg.head_dim)
    u = head.fc(features)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    total = features.new_zeros(())
    stats: list[tuple[int, int]] = []
    right: list[torch.Tensor] = []
    counts: list[torch.Tensor] = []
    for j in range(depth):
        q, k, v = head.qkv(next_ids, u, pos)
        keys.append(head.expand_kv(k))
        values.append(head.expand_kv(v))
        s0 = (q @ keys[0].transpose(-1, -2)) * scale  # [B, h, T, T]
        allowed = pos[None, :] <= (pos[:, None] - j)
        s0 = s0.masked_fill(~allowed, float("-inf"))
        diag = [((q * _shift(keys[i], j - i)).sum(-1) * scale)[..., None] for i in range(1, j + 1)]
        scores = torch.cat([s0, *diag], -1) if diag else s0
        probs = torch.nan_to_num(scores.softmax(-1))  # rows with no key at all: t < j
        attn = probs[..., :t] @ values[0]
        for i in range(1, j + 1):
            attn = attn + probs[..., t + i - 1 : t + i] * _shift(values[i], j - i)
        g = head.finish(u, attn)
        lab = labels.clone()
        lab[:, :j] = -1  # no origin before position 0
        mask = lab >= 0
        counted = lab != -1  # out-of-vocabulary choices count as misses
        hit = torch.zeros_like(mask)
        if bool(mask.any()):
            logits = head.logits(g[mask])
            target = lab[mask]
            if soft is None:
                total = total + F.cross_entropy(logits, target)
            else:
                total = total + _soft_cross_entropy(logits, soft[0][mask], soft[1][mask])
            hit[mask] = logits.argmax(-1) == target
        stats.append((int(hit.sum()), int(counted.sum())))
        right.append(hit)
        counts.append(counted)
        u = _shift(g, 1)  # depth j+1 at t continues from depth j at t-1
    return TTTResult(total / depth, stats, torch.stack(right), torch.stack(counts))


def _soft_cross_entropy(
    logits: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor
) -> torch.Tensor:
    """Mean over rows of -sum_k p_k log q(ids_k), p the top-K probabilities renormalised over
    the ids inside the draft vocabulary (ids < 0 weigh nothing)."""
    weight = torch.where(ids >= 0, probs, torch.zeros_like(probs))
    weight = weight / weight.sum(-1, keepdim=True).clamp_min(1e-9)
    logp = logits.log_softmax(-1).gather(-1, ids.clamp_min(0))
    return -(weight * logp).sum(-1).mean()


def _shift(x: torch.Tensor, n: int) -> torch.Tensor:
    """x moved n positions later along the sequence axis (-2), zeros in front."""
    if n == 0:
        return x
    pad = torch.zeros_like(x[..., :n, :])
    return torch.cat([pad, x[..., :-n, :]], -2)
