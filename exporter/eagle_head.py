"""The EAGLE-3-class draft head: one small decoder layer over the target's own hidden states.

At position t the head reads the target's features f_t (the hidden states of a low, a middle
and a high layer, concatenated: [3H], see ``passes.eagle_features``) and the embedding of the
token at t+1, and predicts the token at t+2 over a reduced draft vocabulary (the N tokens the
training answers use most; ``draft_ids`` maps them back to target ids)::

    u   = fc(f_t) + hidden_in                       [H]   (hidden_in: the head's own output g
                                                           of the previous draft position, or 0)
    x   = concat(g_e * rmsnormed(embed(tok_{t+1})), norm_h(u))  [2H]
    h   = u + o_proj(attention(q(x), k(x), v(x)))    causal over its own KV of earlier positions
    g   = h + mlp(norm_m(h))                         [H]   -> hidden_out, the next draft's input
    tok = draft_ids[argmax(lm_head(norm_f(g)))]

The first draft after a verify runs on the target's features (``hidden_in`` = 0); each later
draft feeds the head its own g instead (``features`` = 0, and ``fc`` has no bias, so fc(0) = 0).
Training runs exactly that ("training-time test", ``ttt_loss``): at depth j the head sees its
own depth j-1 output, attending to real-feature keys up to its origin and to its own earlier
draft keys, so acceptance holds past the first draft token.

The token embedding is the target's (frozen, so stored RMS-normalised; in fp16 in the draft
graph, cast back: the head only needs it as an input signal), the LM head starts from the target's rows of the draft
vocabulary and is trained.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

logger = logging.getLogger(__name__)

INPUTS = ("input_ids", "features", "hidden_in", "past_key", "past_value")
OUTPUTS = ("draft_token", "draft_logits", "hidden_out", "present_key", "present_value")


@dataclass
class EagleConfig:
    """The head's shape: the target's width, attention layout and RoPE, the draft vocabulary."""

    hidden: int  # H, the target's hidden size
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    rope_theta: float
    eps: float
    vocab: int  # the target's vocabulary (embedding rows)
    draft_vocab: int  # rows of the head's LM head
    feature_layers: int = 3

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(var + self.eps) * self.weight


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE on x [B, h, S, Dh] at positions pos [S] (the Llama convention)."""
    dh = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, dh, 2, dtype=torch.float32) / dh))
    ang = pos.to(torch.float32)[:, None] * inv[None, :]  # [S, Dh/2]
    cos = torch.cat([ang.cos(), ang.cos()], -1)
    sin = torch.cat([ang.sin(), ang.sin()], -1)
    half = dh // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rot * sin


@dataclass
class TTTResult:
    """What ``EagleHead.ttt_loss`` computed over a batch."""

    loss: torch.Tensor  # mean cross-entropy over the depths
    stats: list[tuple[int, int]]  # (right, counted) per depth
    right: torch.Tensor  # [depth, B, T] bool: depth j's draft at position t was the choice
    counted: torch.Tensor  # [depth, B, T] bool: position t has a label at depth j


class EagleHead(nn.Module):
    """One decoder layer fed by the target's features and the next token's embedding."""

    embed: torch.Tensor  # [V, H] RMS-normalised token embedding (frozen buffer)
    draft_ids: torch.Tensor  # [Vd] target id of each draft-vocabulary row

    def __init__(self, cfg: EagleConfig, embed: torch.Tensor, draft_ids: torch.Tensor) -> None:
        super().__init__()
        self.cfg = cfg
        h, dh = cfg.hidden, cfg.head_dim
        e = embed.detach().to(torch.float32)
        # the embedding is frozen, so its RMS normalisation is precomputed; only the gain learns
        normed = e * torch.rsqrt(e.pow(2).mean(-1, keepdim=True) + cfg.eps)
        self.register_buffer("embed", normed, persistent=True)
        self.register_buffer("draft_ids", draft_ids.to(torch.long).clone(), persistent=True)
        self.fc = nn.Linear(cfg.feature_layers * h, h, bias=False)
        self.embed_gain = nn.Parameter(torch.ones(h))
        self.norm_h = RMSNorm(h, cfg.eps)
        self.q_proj = nn.Linear(2 * h, cfg.heads * dh, bias=False)
        self.k_proj = nn.Linear(2 * h, cfg.kv_heads * dh, bias=False)
        self.v_proj = nn.Linear(2 * h, cfg.kv_heads * dh, bias=False)
        self.o_proj = nn.Linear(cfg.heads * dh, h, bias=False)
        self.norm_m = RMSNorm(h, cfg.eps)
        self.gate = nn.Linear(h, cfg.intermediate, bias=False)
        self.up = nn.Linear(h, cfg.intermediate, bias=False)
        self.down = nn.Linear(cfg.intermediate, h, bias=False)
        self.norm_f = RMSNorm(h, cfg.eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab, bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(e[self.draft_ids])
            for lin in (self.o_proj, self.down):
                lin.weight.mul_(0.5)

    # ---- pieces shared by inference and training ----------------------------------------
    def qkv(
        self, tokens: torch.Tensor, u: torch.Tensor, pos: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, h, S, Dh], k and v [B, hkv, S, Dh] (RoPE applied) of tokens [B, S], u [B, S, H]."""
        cfg = self.cfg
        b, s = tokens.shape
        x = torch.cat([self.embed[tokens].float() * self.embed_gain, self.norm_h(u)], -1)
        q = self.q_proj(x).view(b, s, cfg.heads, cfg.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, cfg.kv_heads, cfg.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, cfg.kv_heads, cfg.head_dim).transpose(1, 2)
        return rope(q, pos, cfg.rope_theta), rope(k, pos, cfg.rope_theta), v

    def finish(self, u: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """g = the layer's output from u [B, S, H] and attention output attn [B, h, S, Dh]."""
        b, _, s, _ = attn.shape
        h = u + self.o_proj(attn.transpose(1, 2).reshape(b, s, -1))
        m = self.norm_m(h)
        return h + self.down(F.silu(self.gate(m)) * self.up(m))

    def logits(self, g: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm_f(g))  # type: ignore[no-any-return]

    def _expand(self, kv: torch.Tensor) -> torch.Tensor:
        rep = self.cfg.heads // self.cfg.kv_heads
        return kv.repeat_interleave(rep, dim=1) if rep > 1 else kv

    # ---- inference (the exported graph) ----------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,  # [B, S] int64: the token after each position
        features: torch.Tensor,  # [B, S, 3H] the target's features (0 for draft positions)
        hidden_in: torch.Tensor,  # [B, S, H] the head's own earlier output (0 for real ones)
        past_key: torch.Tensor,  # [B, Hkv, P, Dh]
        past_value: torch.Tensor,  # [B, Hkv, P, Dh]
    ) -> tuple[torch.Tensor, ...]:
        s = input_ids.shape[1]
        p = past_key.shape[2]
        pos = torch.arange(s) + p
        u = self.fc(features) + hidden_in
        q, k, v = self.qkv(input_ids, u, pos)
        keys = torch.cat([past_key, k], 2)
        values = torch.cat([past_value, v], 2)
        scores = q @ self._expand(keys).transpose(-1, -2) / math.sqrt(self.cfg.head_dim)
        allowed = torch.arange(p + s)[None, :] <= pos[:, None]  # [S, P+S]
        scores = scores.masked_fill(~allowed, float("-inf"))
        attn = scores.softmax(-1) @ self._expand(values)
        g = self.finish(u, attn)
        logits = self.logits(g[:, -1])  # [B, Vd]: only the last position drafts
        token = self.draft_ids[logits.argmax(-1)]
        return token, logits, g, keys, values

    # ---- training: the training-time test ----------------------------------------------------
    def ttt_loss(
        self,
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
        scale = 1.0 / math.sqrt(self.cfg.head_dim)
        u = self.fc(features)
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        total = features.new_zeros(())
        stats: list[tuple[int, int]] = []
        right: list[torch.Tensor] = []
        counts: list[torch.Tensor] = []
        for j in range(depth):
            q, k, v = self.qkv(next_ids, u, pos)
            keys.append(self._expand(k))
            values.append(self._expand(v))
            s0 = (q @ keys[0].transpose(-1, -2)) * scale  # [B, h, T, T]
            allowed = pos[None, :] <= (pos[:, None] - j)
            s0 = s0.masked_fill(~allowed, float("-inf"))
            diag = [
                ((q * _shift(keys[i], j - i)).sum(-1) * scale)[..., None] for i in range(1, j + 1)
            ]
            scores = torch.cat([s0, *diag], -1) if diag else s0
            probs = torch.nan_to_num(scores.softmax(-1))  # rows with no key at all: t < j
            attn = probs[..., :t] @ values[0]
            for i in range(1, j + 1):
                attn = attn + probs[..., t + i - 1 : t + i] * _shift(values[i], j - i)
            g = self.finish(u, attn)
            lab = labels.clone()
            lab[:, :j] = -1  # no origin before position 0
            mask = lab >= 0
            counted = lab != -1  # out-of-vocabulary choices count as misses
            hit = torch.zeros_like(mask)
            if bool(mask.any()):
                logits = self.logits(g[mask])
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
