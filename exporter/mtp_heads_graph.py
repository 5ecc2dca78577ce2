"""The MTP heads as a standalone onnxruntime graph: what a token tree asks the heads for.

The in-graph chain branch (``MTPBranch``) drafts one token per depth, greedily, inside the
verify run. A token tree wants more: the top-W tokens of head k for several kept candidates at
once, and the chained hidden state of each, so the runtime (torch-free) can grow the tree
best-first on the heads' own log-probabilities. One graph serves every depth::

    inputs   mtp_tree_hidden [N, H] float32   hidden state to continue from (depth 1: the
                                               base model's LM-head input at the accepted node)
             mtp_tree_tokens [N] int64         the token that follows each hidden state
             mtp_tree_head   [1] int64         which head runs (0-based depth)
    outputs  mtp_tree_next   [N, H] float32    the head's hidden state (input of head + 1)
             mtp_tree_ids    [N, W] int64      top-W token ids (already mapped through to_vocab)
             mtp_tree_logp   [N, W] float32    their log-probabilities under the head

The head is picked with ``torch.cond`` (an ONNX ``If`` per head): only that head's nodes run,
and the shared embedding and LM head are stored once for all heads. Heads that fold
(``mtp_fold``) run folded, as in the chain branch. W is fixed at export
(``MAX_TREE_WIDTH``); a caller takes the first columns it needs (TopK's order is best first).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specport.core.contract import MAX_TREE_WIDTH
from specport.exporter.mtp_fold import fold_heads
from specport.exporter.mtp_heads import export_module

logger = logging.getLogger(__name__)

HEADS_GRAPH_NAME = "mtp_heads.onnx"
HEADS_GRAPH_DATA = "mtp_heads.onnx.data"
HEADS_INPUTS = ("mtp_tree_hidden", "mtp_tree_tokens", "mtp_tree_head")
HEADS_OUTPUTS = ("mtp_tree_next", "mtp_tree_ids", "mtp_tree_logp")


class HeadsTopK(nn.Module):
    """forward(hidden [N, H], tokens [N], head [1]) -> (hidden' [N, H], ids [N, W], logp [N, W])."""

    def __init__(self, heads: Any, width: int, fold: bool = True) -> None:
        super().__init__()
        self.mtp = heads
        # Register the shared modules here so the exporter sees their weights as parameters.
        self.embed_tokens, self.lm_head, self.rotary_emb = heads._shared
        self.draft_head = heads._draft  # the draft vocabulary's LM-head rows, if any
        self.folded = fold_heads(heads) if fold else None
        self.width = min(int(width), int(heads.draft_size))

    def _branch(self, k: int) -> Any:
        """Head k: (hidden [N, H], tokens [N]) -> (hidden' [N, H], normed [N, H]).

        The LM head stays out of the branches: run inside an ``If`` branch (its weight read
        from the outer scope) a 49k x 576 head took 1.8x as long per call as in the main graph
        (onnxruntime 1.32, 1 thread); the heads' own, smaller weights showed no such cost."""

        def run(hidden: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h, t = hidden[None], tokens[None]  # [1, N, H], [1, N]
            if self.folded is not None:
                out, normed = self.folded[k](h, t)
            else:
                mtp = self.mtp
                head: Any = mtp.heads[k]
                out = head(h, mtp.embed(t), mtp.position_embeddings(h))
                normed = head.norm(out)
            return out[0], normed[0]

        return run

    def _pick(self, head: torch.Tensor, k: int) -> Any:
        """Head k's step if ``head`` == k, else the next head's (the last one needs no test)."""
        if k == self.mtp.num_heads - 1:
            return self._branch(k)
        this, rest = self._branch(k), self._pick(head, k + 1)

        def run(hidden: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.cond(head[0] == k, this, rest, (hidden, tokens))  # type: ignore[return-value]

        return run

    def forward(
        self,
        hidden: torch.Tensor,  # [N, H]
        tokens: torch.Tensor,  # [N] int64
        head: torch.Tensor,  # [1] int64
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out, normed = self._pick(head, 0)(hidden, tokens)
        logits = self.mtp.project(normed).float()  # [N, D] over the heads' vocabulary
        logp = torch.log_softmax(logits, dim=-1)
        top, index = torch.topk(logp, self.width, dim=-1)  # [N, W] best first
        return out, self.mtp.to_vocab(index), top


def export_heads_graph(heads: Any, width: int = MAX_TREE_WIDTH) -> Any:
    """``HeadsTopK`` as an ``onnx_ir.Model`` (inputs HEADS_INPUTS, outputs HEADS_OUTPUTS)."""
    from torch.export import Dim

    module = HeadsTopK(heads, width).eval()
    first: Any = heads.heads[0]
    hidden_size = int(first.eh_proj.weight.shape[0])
    vocab = int(module.lm_head.weight.shape[0])
    g = torch.Generator().manual_seed(0)
    n = 3
    args = (
        torch.randn(n, hidden_size, generator=g),
        torch.randint(0, vocab, (n,), generator=g),
        torch.zeros(1, dtype=torch.int64),
    )
    rows = Dim("rows")
    shapes = {"hidden": {0: rows}, "tokens": {0: rows}, "head": None}

    model = export_module(module, args, shapes, HEADS_INPUTS, HEADS_OUTPUTS, "the MTP heads graph")
    from onnx_ir.passes.common import ClearMetadataAndDocStringPass

    ClearMetadataAndDocStringPass()(model)  # the exporter's stack traces: ~10 kB per node
    return model


def save_heads_graph(heads: Any, directory: Path, width: int = MAX_TREE_WIDTH) -> dict[str, Any]:
    """Write ``mtp_heads.onnx`` (+ its external data) into ``directory``; the manifest record."""
    import onnx_ir as ir

    model = export_heads_graph(heads, width)
    ir.save(model, Path(directory) / HEADS_GRAPH_NAME, external_data=HEADS_GRAPH_DATA)
    top = next(v for v in model.graph.outputs if v.name == HEADS_OUTPUTS[1])
    return {
        "file": HEADS_GRAPH_NAME,
        "inputs": dict(zip(("hidden", "tokens", "head"), HEADS_INPUTS)),
        "outputs": dict(zip(("hidden", "ids", "logp"), HEADS_OUTPUTS)),
        "width": int(top.shape[1]) if top.shape is not None else int(width),
    }
