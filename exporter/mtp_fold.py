"""Export-time folding of a trained MTP head into fewer, larger constant ops (exact algebra).

For a small model on CPU the branch's cost is the number of ONNX nodes, not FLOPs, so three
affine pieces are precomputed once:

* ``enorm(embed(t)) @ W_e`` depends on the token only: one ``[V, H]`` table, a single Gather
  (only when the tables stay small: ``V * H * K`` up to 16M floats);
* single-position attention ``o_proj(repeat_kv(v_proj(x)))`` is affine in x: one Linear;
* the hidden half of ``eh_proj`` stays a MatMul on ``hnorm(h)``.

The folded head computes the same function as `MTPHead` (up to float rounding; drafts are only
proposals, so a rare rounding flip costs acceptance, never correctness).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

MAX_TABLE_FLOATS = 1 << 24


def _linear_from(fn: Any, hidden: int) -> nn.Linear:  # fn: affine [1, N, H] -> [1, N, H]
    with torch.no_grad():
        zero = fn(torch.zeros(1, 1, hidden))[0, 0]  # bias
        cols = fn(torch.eye(hidden)[None])[0] - zero  # row i = W @ e_i
        lin = nn.Linear(hidden, hidden, bias=True)
        lin.weight.copy_(cols.T)
        lin.bias.copy_(zero)
    return lin.requires_grad_(False)


class FoldedHead(nn.Module):
    """hidden [B, N, H], tokens [B, N] -> (hidden' [B, N, H], normed [B, N, H])."""

    def __init__(self, head: Any, embed: Any, fold_embed: bool) -> None:
        super().__init__()
        hidden = int(head.eh_proj.weight.shape[0])
        w = head.eh_proj.weight.detach()  # [H, 2H]: [embedding half | hidden half]
        self.hnorm = head.hnorm
        self.h_proj = nn.Linear(hidden, hidden, bias=False).requires_grad_(False)
        with torch.no_grad():
            self.h_proj.weight.copy_(w[:, hidden:])
            if fold_embed:
                table = head.enorm(embed.weight.detach()) @ w[:, :hidden].T  # [V, H]
                self.e_table: nn.Module | None = nn.Embedding.from_pretrained(table)
            else:
                self.e_table = None
                self.embed, self.enorm = embed, head.enorm
                self.e_proj = nn.Linear(hidden, hidden, bias=False).requires_grad_(False)
                self.e_proj.weight.copy_(w[:, :hidden])
        blk: Any = head.block
        self.ln1, self.ln2, self.mlp, self.norm = (
            blk.input_layernorm,
            blk.post_attention_layernorm,
            blk.mlp,
            head.norm,
        )
        self.vo = _linear_from(head.collapsed_attention, hidden)

    def forward(
        self, hidden: torch.Tensor, tokens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        m: Any = self  # torch's stubs type submodules as Tensor | Module
        if m.e_table is not None:
            e = m.e_table(tokens)
        else:
            e = m.e_proj(m.enorm(m.embed(tokens)))
        x = e + m.h_proj(m.hnorm(hidden))
        x = x + m.vo(m.ln1(x))
        x = x + m.mlp(m.ln2(x))
        return x, m.norm(x)


def fold_heads(heads: Any) -> nn.ModuleList | None:
    """Folded copies of every head, or None when a head is not a collapsible (Llama-like) block."""
    if not all(h.collapsed for h in heads.heads):
        return None
    embed = heads._shared[0]
    vocab, hidden = embed.weight.shape
    fold_embed = vocab * hidden * heads.num_heads <= MAX_TABLE_FLOATS
    logger.info("folding %d MTP heads (embedding tables: %s)", heads.num_heads, fold_embed)
    return nn.ModuleList(FoldedHead(h, embed, fold_embed) for h in heads.heads).eval()
