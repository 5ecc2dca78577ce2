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
Training runs exactly that ("training-time test", ``train.eagle_objective.ttt_loss``): at depth
j the head sees its own depth j-1 output, attending to real-feature keys up to its origin and to
its own earlier draft keys, so acceptance holds past the first draft token. This module is the
head as the exporter writes it (``eagle_artifact``, ``eagle_graph``); its training lives in
``specport.train``.

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

    # ---- pieces shared by inference and training (train.eagle_objective) -------------
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

    def expand_kv(self, kv: torch.Tensor) -> torch.Tensor:
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
        scores = q @ self.expand_kv(keys).transpose(-1, -2) / math.sqrt(self.cfg.head_dim)
        allowed = torch.arange(p + s)[None, :] <= pos[:, None]  # [S, P+S]
        scores = scores.masked_fill(~allowed, float("-inf"))
        attn = scores.softmax(-1) @ self.expand_kv(values)
        g = self.finish(u, attn)
        logits = self.logits(g[:, -1])  # [B, Vd]: only the last position drafts
        token = self.draft_ids[logits.argmax(-1)]
        return token, logits, g, keys, values
