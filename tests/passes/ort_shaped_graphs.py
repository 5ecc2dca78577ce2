"""Tiny transformer graphs shaped like onnxruntime's transformer-fusion test data, built here.

onnxruntime's `test_data/models` (gpt2_past.onnx, gpt2_megatron.onnx, attention_mha.onnx, the
one-layer gpt2_attention variants) are TorchScript exports of GPT-2-style blocks: a Conv1D
(MatMul + bias Add) that makes Q, K and V at once, a Split, heads by Reshape/Transpose, a
stacked past [2, B, H, P, Dh], a causal mask from a uint8 `bias` buffer applied with Where and
-10000, the attention mask as (1 - mask) * -10000; Megatron applies the causal mask by
multiplication (scores * ltor - 10000 * (1 - ltor)); the MHA block is BERT-style attention
(separate Q/K/V projections, a padding mask, no cache). The files also carry the blemishes
onnx's checker refuses and onnxruntime ignores: graph outputs without a type, value_info
without a type, stale shape annotations. `build(kind, path, blemish)` makes each here.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import onnx

HIDDEN, HEADS, VOCAB, CONTEXT = 32, 4, 64, 32
KINDS = ("gpt2_past", "gpt2_nopast", "gpt2_megatron", "mha_block")
BLEMISHES = ("typeless_outputs", "typeless_value_info", "stale_shapes")


def _modules():
    import torch
    from torch import nn

    class Block(nn.Module):
        """One GPT-2 layer (pre-norm); `style` picks the causal mask's arithmetic."""

        def __init__(self, style: str):
            super().__init__()
            self.style = style
            self.ln_1, self.ln_2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
            self.c_attn = nn.Linear(HIDDEN, 3 * HIDDEN)
            self.c_proj = nn.Linear(HIDDEN, HIDDEN)
            self.fc, self.proj = nn.Linear(HIDDEN, 4 * HIDDEN), nn.Linear(4 * HIDDEN, HIDDEN)
            tril = torch.tril(torch.ones(CONTEXT, CONTEXT))
            self.register_buffer("bias", tril.to(torch.uint8)[None, None])
            self.register_buffer("ltor", tril[None, None])

        def heads(self, x):  # [B, S, H*Dh] -> [B, H, S, Dh]
            b, s, _ = x.shape
            return x.view(b, s, HEADS, HIDDEN // HEADS).transpose(1, 2)

        def forward(self, x, mask, past=None):
            q, k, v = self.c_attn(self.ln_1(x)).split(HIDDEN, dim=2)
            q, k, v = self.heads(q), self.heads(k), self.heads(v)
            if past is not None:
                k = torch.cat([past[0], k], dim=-2)
                v = torch.cat([past[1], v], dim=-2)
            present = torch.stack([k, v])
            w = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(HIDDEN // HEADS)
            s, t = q.shape[-2], k.shape[-2]
            if self.style == "megatron":
                ltor = self.ltor[:, :, t - s : t, :t]
                w = w * ltor - 10000.0 * (1.0 - ltor)
            elif self.style == "gpt2":
                causal = self.bias[:, :, t - s : t, :t].bool()
                w = torch.where(causal, w, torch.tensor(-10000.0))
            w = w + (1.0 - mask[:, None, None, :].float()) * -10000.0
            a = torch.matmul(w.softmax(-1), v).transpose(1, 2).reshape(x.shape)
            x = x + self.c_proj(a)
            x = x + self.proj(torch.nn.functional.gelu(self.fc(self.ln_2(x)), approximate="tanh"))
            return x, present

    class Model(nn.Module):
        def __init__(self, style: str, layers: int):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(VOCAB, HIDDEN), nn.Embedding(CONTEXT, HIDDEN)
            self.h = nn.ModuleList([Block(style) for _ in range(layers)])
            self.ln_f = nn.LayerNorm(HIDDEN)

        def forward(self, input_ids, position_ids, attention_mask, *past):
            x = self.wte(input_ids) + self.wpe(position_ids)
            presents = []
            for i, block in enumerate(self.h):
                x, present = block(x, attention_mask, past[i] if past else None)
                presents.append(present)
            logits = self.ln_f(x) @ self.wte.weight.T
            return (logits, *presents) if past else logits

    return torch, Model


def _export(path: Path, style: str, layers: int, with_past: bool, opset: int) -> None:
    torch, model_cls = _modules()
    torch.manual_seed(0)
    model = model_cls(style, layers).eval()
    with torch.no_grad():  # non-trivial norms and biases: a mis-wired fusion shows
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    b, s, p = 2, 3, 4 if with_past else 0
    d = HIDDEN // HEADS
    ids = torch.randint(0, VOCAB, (b, s))
    args = [ids, torch.arange(p, p + s).expand(b, s), torch.ones(b, p + s, dtype=torch.int64)]
    names = ["input_ids", "position_ids", "attention_mask"]
    axes: dict[str, dict[int, str]] = {
        "input_ids": {0: "batch", 1: "seq"},
        "position_ids": {0: "batch", 1: "seq"},
        "attention_mask": {0: "batch", 1: "total_seq"},
        "logits": {0: "batch", 1: "seq"},
    }
    outs = ["logits"]
    if with_past:
        for i in range(layers):
            args.append(torch.randn(2, b, HEADS, p, d))
            names.append(f"past_{i}")
            outs.append(f"present_{i}")
            axes[f"past_{i}"] = {1: "batch", 3: "past_seq"}
            axes[f"present_{i}"] = {1: "batch", 3: "total_seq"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model,
            tuple(args),
            str(path),
            dynamo=False,
            opset_version=opset,
            input_names=names,
            output_names=outs,
            dynamic_axes=axes,
        )


def add_blemish(path: Path, blemish: str) -> None:
    """Give `path` one blemish that onnx's checker (or strict shape inference) objects to and
    onnxruntime ignores, as files from other tools carry them."""
    model = onnx.load(str(path))
    graph = model.graph
    if blemish == "typeless_outputs":  # what old optimizers left in onnxruntime's test data
        for out in graph.output:
            out.ClearField("type")
    elif blemish == "typeless_value_info":
        for node in list(graph.node)[:10]:
            graph.value_info.append(onnx.ValueInfoProto(name=node.output[0]))
    elif blemish == "stale_shapes":  # annotations an edit left behind: wrong vocab and width
        inferred = onnx.shape_inference.infer_shapes(model)
        for vi in inferred.graph.value_info:
            dims = vi.type.tensor_type.shape.dim
            if vi.name.endswith("wte/Gather_output_0"):
                dims[2].dim_value = HIDDEN + 1
                graph.value_info.append(vi)
        graph.output[0].type.tensor_type.shape.dim[2].dim_value = VOCAB + 1
    else:
        raise ValueError(blemish)
    onnx.save(model, str(path))


def build(kind: str, path: Path, blemish: str | None = None, layers: int = 1) -> Path:
    """Write the `kind` graph (see KINDS) to `path`, with `blemish` (see BLEMISHES) if given."""
    path.parent.mkdir(parents=True, exist_ok=True)
    style = {"gpt2_megatron": "megatron", "mha_block": "none"}.get(kind, "gpt2")
    with_past = kind in ("gpt2_past", "gpt2_megatron")
    _export(path, style, layers, with_past, opset=11 if kind == "gpt2_past" else 14)
    if blemish is not None:
        add_blemish(path, blemish)
    return path
