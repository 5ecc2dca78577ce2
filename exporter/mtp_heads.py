"""DeepSeek-V3-style multi-token-prediction (MTP) heads in torch, and the graph branch built on them.

Head k takes the previous depth's hidden state h (the base model's LM-head input for k = 1)
and the embedding of the token that follows it, and predicts the token after that::

    x   = eh_proj(cat(enorm(embed(t)), hnorm(h)))      # [B, N, 2H] -> [B, N, H]
    h'  = block(x)                                     # one decoder layer of the base family
    p   = lm_head(norm(h'))                            # shared LM head (frozen), own final norm

K heads chain: head k+1 gets h' of head k and the token head k drafted. Unlike DeepSeek-V3's
training-time module, the block here attends to its own position only (no MTP KV cache):
the base model's hidden state carries the context, the graph stays one fixed-size branch, and
training and inference see exactly the same computation. Real DeepSeek-V3 MTP weights load
into the same module (`load_deepseek_mtp`, in `mtp_weights` with our own weight files'
save / load), run the same way.

`MTPBranch` is what goes into the exported graph: from the verify run's [B, S] ids, logits and
hidden states it computes the greedy accepted prefix, the bonus token and K new drafts.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from specport.core.errors import ExportError, InputError
from specport.exporter.mtp_fold import fold_heads

logger = logging.getLogger(__name__)


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., H]
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)  # one RMSNormalization node


def _decoder_parts(base: Any) -> tuple[type[nn.Module], nn.Module, nn.Module]:
    """(decoder layer class, rotary embedding, final norm) of a Llama-like HF causal LM."""
    inner = getattr(base, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "rotary_emb"):
        raise InputError(
            f"MTP heads need a rotary decoder-only model (model.layers + model.rotary_emb); "
            f"{type(base).__name__} has a different layout. Use --speculative ngram|draft for it."
        )
    return type(inner.layers[0]), inner.rotary_emb, inner.norm


class MTPHead(nn.Module):
    """One MTP depth: hidden [B, N, H] + next-token embedding [B, N, H] -> hidden [B, N, H]."""

    def __init__(
        self, config: Any, layer_cls: type[nn.Module], final_norm: nn.Module, layer_idx: int
    ) -> None:
        super().__init__()
        hidden = int(config.hidden_size)
        eps = float(getattr(config, "rms_norm_eps", 1e-6))
        self.enorm = RMSNorm(hidden, eps)
        self.hnorm = RMSNorm(hidden, eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.block = layer_cls(config, layer_idx=layer_idx)
        self.norm = copy.deepcopy(final_norm)
        with torch.no_grad():  # start as "pass the hidden state through, plus a little token"
            w = torch.zeros(hidden, 2 * hidden)
            w[:, hidden:] = torch.eye(hidden)
            w[:, :hidden] = torch.randn(hidden, hidden) * 0.02
            self.eh_proj.weight.copy_(w)

    def forward(
        self,
        hidden: torch.Tensor,  # [B, N, H]
        embeds: torch.Tensor,  # [B, N, H]
        position_embeddings: tuple[torch.Tensor, torch.Tensor],  # cos, sin [1, 1, Dh]
    ) -> torch.Tensor:  # [B, N, H]
        b, n, h = hidden.shape
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        if self.collapsed:
            return self._collapsed_block(x)
        x = x.reshape(b * n, 1, h)  # every position attends to itself only
        block: Any = self.block
        out = block(x, attention_mask=None, position_embeddings=position_embeddings)
        if isinstance(out, tuple):
            out = out[0]
        return out.reshape(b, n, h)

    @property
    def collapsed(self) -> bool:
        """True for a plain pre-norm block with separate q/k/v projections (Llama, Qwen, Mistral).

        Attention over a single position puts all weight on that position, so the block reduces
        exactly to o_proj(v_proj(x)): no q/k projections, rotary or softmax in the graph, which
        makes the branch about a third of the nodes (what matters for small models on CPU).
        """
        blk: Any = self.block
        attn = getattr(blk, "self_attn", None)
        return (
            attn is not None
            and all(hasattr(attn, a) for a in ("v_proj", "o_proj"))
            and all(hasattr(blk, a) for a in ("input_layernorm", "post_attention_layernorm", "mlp"))
            and not any(
                hasattr(blk, a) for a in ("pre_feedforward_layernorm", "post_feedforward_layernorm")
            )
        )

    def collapsed_attention(self, x: torch.Tensor) -> torch.Tensor:  # normed [B, N, H] -> [B, N, H]
        attn: Any = self.block.self_attn
        v = attn.v_proj(x)  # [B, N, Hkv*Dh]
        rep = int(getattr(attn, "num_key_value_groups", 1))
        if rep > 1:  # GQA: query head j reads kv head j // rep
            b, n, _ = v.shape
            dh = int(attn.head_dim)
            v = v.reshape(b, n, -1, 1, dh).expand(-1, -1, -1, rep, -1).reshape(b, n, -1)
        return attn.o_proj(v)

    def _collapsed_block(self, x: torch.Tensor) -> torch.Tensor:  # [B, N, H] -> [B, N, H]
        blk: Any = self.block
        x = x + self.collapsed_attention(blk.input_layernorm(x))
        return x + blk.mlp(blk.post_attention_layernorm(x))


class MTPHeads(nn.Module):
    """K chained heads sharing the frozen base model's embedding and LM head."""

    def __init__(self, base: Any, num_heads: int, draft_vocab: torch.Tensor | None = None) -> None:
        super().__init__()
        if not 1 <= num_heads <= 8:
            raise InputError(f"--heads must be in 1..8, got {num_heads}")
        layer_cls, rotary, final_norm = _decoder_parts(base)
        config = base.config
        n_layers = int(config.num_hidden_layers)
        self.heads = nn.ModuleList(
            MTPHead(config, layer_cls, final_norm, n_layers + k) for k in range(num_heads)
        )
        last = base.model.layers[-1].state_dict()
        for head in self.heads:  # warm start: the block begins as a copy of the last layer
            head.get_submodule("block").load_state_dict(last, strict=False)
        # Shared, frozen pieces are held outside the module tree so state_dict() is heads only.
        self._shared: tuple[Any, Any, Any] = (
            base.get_input_embeddings(),
            base.get_output_embeddings(),
            rotary,
        )
        self._draft: nn.Linear | None = None
        if draft_vocab is not None:
            self.set_draft_vocab(draft_vocab)

    def set_draft_vocab(self, ids: torch.Tensor) -> None:
        """Score only ``ids`` (int64 token ids): the heads' LM head becomes those rows.

        A head's cost is mostly its LM head: with a 49k vocabulary every head reads the whole
        [V, H] matrix again (113 MB in fp32 for SmolLM2, more than a CPU's last-level cache), so
        K heads cost about half a decode step. The tokens a model's answers use are a small
        subset; scoring the most frequent few thousand keeps nearly every accepted draft and
        makes the matrix small enough to stay in cache. A token outside the subset is never
        drafted (its position is simply not accepted), so output is unchanged."""
        ids = torch.as_tensor(ids, dtype=torch.int64).flatten()
        vocab = int(self._shared[1].weight.shape[0])
        if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise InputError(f"draft vocabulary ids must be in 0..{vocab - 1}")
        self.register_buffer("draft_vocab", ids.clone())
        head = self._shared[1]
        lin = nn.Linear(head.weight.shape[1], ids.numel(), bias=head.bias is not None)
        with torch.no_grad():
            lin.weight.copy_(head.weight[ids])
            if head.bias is not None:
                lin.bias.copy_(head.bias[ids])
        # Held outside the module tree like the shared LM head: frozen, and not in state_dict()
        # (the ids are; the rows are the LM head's).
        object.__setattr__(self, "_draft", lin.requires_grad_(False))
        index = torch.full((vocab,), -100, dtype=torch.int64)
        index[ids] = torch.arange(ids.numel())
        self._vocab_index = index

    @property
    def draft_size(self) -> int:
        """Number of tokens the heads score (the full vocabulary without a draft vocabulary)."""
        head = self._shared[1] if self._draft is None else self._draft
        return int(head.weight.shape[0])

    def draft_index(self, ids: torch.Tensor) -> torch.Tensor:
        """Indices into the heads' logits of token ``ids`` (-100, cross-entropy's ignore index,
        for tokens outside the draft vocabulary)."""
        return ids if self._draft is None else self._vocab_index[ids]

    def project(self, normed: torch.Tensor) -> torch.Tensor:  # [B, N, H] -> [B, N, draft_size]
        """Logits over the heads' vocabulary of a normed hidden state (the shared LM head, or
        its draft-vocabulary rows)."""
        head = self._shared[1] if self._draft is None else self._draft
        return head(normed)

    @property
    def num_heads(self) -> int:
        return len(self.heads)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:  # [B, N] -> [B, N, H]
        return self._shared[0](ids)

    def lm_logits(self, k: int, hidden: torch.Tensor) -> torch.Tensor:  # [B, N, H] -> [B, N, D]
        head: Any = self.heads[k]
        return self.project(head.norm(hidden))

    def position_embeddings(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.zeros(1, 1, dtype=torch.long)
        return self._shared[2](like, pos)

    def to_vocab(self, index: torch.Tensor) -> torch.Tensor:
        """Token ids of indices into the heads' logits (what `step` and `lm_logits` score)."""
        if self._draft is None:
            return index
        ids: torch.Tensor = self.get_buffer("draft_vocab")
        return ids[index]

    def step(
        self, k: int, hidden: torch.Tensor, tokens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Head k on hidden [B, N, H] and the following tokens [B, N] -> (hidden', logits).

        The logits index the heads' own vocabulary: map an argmax or top-k through
        `to_vocab` to get token ids."""
        out = self.heads[k](hidden, self.embed(tokens), self.position_embeddings(hidden))
        return out, self.lm_logits(k, out)


class MTPBranch(nn.Module):
    """forward(hidden [B,S,H], logits [B,S,V], input_ids [B,S]) -> accepted [B], bonus [B], drafts [B,K].

    Position 0 of the run is the last accepted token, positions 1..S-1 the drafts. Greedy
    verification: draft i is accepted while it equals the argmax at position i-1. The hidden
    state at the accepted position and the bonus token (the argmax there) seed the heads.
    """

    def __init__(self, heads: MTPHeads, fold: bool = False) -> None:
        super().__init__()

        self.mtp = heads
        # Register the shared modules here so the exporter sees their weights as parameters.
        self.embed_tokens, self.lm_head, self.rotary_emb = heads._shared
        self.draft_head = heads._draft  # registered so its rows export as weights
        self.folded = fold_heads(heads) if fold else None

    def forward(
        self, hidden: torch.Tensor, logits: torch.Tensor, input_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        best = logits.argmax(dim=-1)  # [B, S]
        miss = (input_ids[:, 1:] != best[:, :-1]).to(torch.int64)  # [B, S-1]
        accepted = (torch.cumsum(miss, dim=1) == 0).to(torch.int64).sum(dim=1)  # [B]
        idx = accepted.unsqueeze(1)  # [B, 1]
        bonus = torch.gather(best, 1, idx)  # [B, 1]
        h = torch.gather(hidden, 1, idx.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))  # [B, 1, H]
        tok = bonus
        drafts = []
        for k in range(self.mtp.num_heads):
            if self.folded is not None:
                h, normed = self.folded[k](h, tok)
                head_logits = self.mtp.project(normed)
            else:
                h, head_logits = self.mtp.step(k, h, tok)
            tok = self.mtp.to_vocab(head_logits.argmax(dim=-1))  # [B, 1]
            drafts.append(tok)
        return accepted, bonus.squeeze(1), torch.cat(drafts, dim=1)


BRANCH_INPUTS = ("mtp_hidden", "mtp_logits", "mtp_input_ids")
BRANCH_OUTPUTS = ("mtp_accepted", "mtp_bonus", "mtp_drafts")


def export_branch(heads: MTPHeads, vocab_size: int, fold: bool = True) -> Any:
    """The MTPBranch as an `onnx_ir.Model` with inputs BRANCH_INPUTS and outputs BRANCH_OUTPUTS."""
    from torch.export import Dim

    branch = MTPBranch(heads, fold=fold).eval()
    first: Any = heads.heads[0]
    hidden_size = int(first.eh_proj.weight.shape[0])
    g = torch.Generator().manual_seed(0)
    b, s = 2, 4
    args = (
        torch.randn(b, s, hidden_size, generator=g),
        torch.randn(b, s, vocab_size, generator=g),
        torch.randint(0, vocab_size, (b, s), generator=g),
    )
    bd, sd = Dim("batch"), Dim("sequence_length")
    shapes = {"hidden": {0: bd, 1: sd}, "logits": {0: bd, 1: sd}, "input_ids": {0: bd, 1: sd}}
    return export_module(branch, args, shapes, BRANCH_INPUTS, BRANCH_OUTPUTS, "the MTP branch")


def export_module(
    module: nn.Module,
    args: tuple[torch.Tensor, ...],
    shapes: dict[str, Any],
    inputs: tuple[str, ...],
    outputs: tuple[str, ...],
    what: str,
) -> Any:
    """``module`` as an `onnx_ir.Model` (dynamo export, opset 23, the exporter's chatter off)."""
    import warnings

    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        try:
            program = torch.onnx.export(
                module,
                args,
                dynamic_shapes=shapes,
                dynamo=True,
                opset_version=23,
                input_names=list(inputs),
                output_names=list(outputs),
                verbose=False,
            )
        except Exception as e:  # noqa: BLE001 - the exporter raises many kinds
            raise ExportError(f"exporting {what} failed: {e}") from e
    if program is None:
        raise ExportError(f"torch.onnx.export returned no program for {what}")
    return program.model
