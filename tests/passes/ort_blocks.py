"""Hand-built attention blocks in the shapes onnxruntime's transformer-fusion tests build them.

onnxruntime's fusion tests (gpt2_model_generator.py, bert_model_generator.py) write one
attention block node by node rather than exporting a model: the inputs are hidden states
(`input_1`, `input_2`), a float `input_mask` [batch_size, past_sequence_length +
sequence_length] or an int mask, and a stacked `past`; dims carry names such as
`past_sequence_length + sequence_length`; opsets 11-16. These builders write the same patterns
with our own code (random weights, no data from onnxruntime):

    gpt2        LayerNorm -> Conv1D (MatMul + Add) -> Split QKV -> heads; past Split/Squeeze and
                Concat; present Unsqueeze/Concat; causal mask Slice(uint8 buffer) -> Cast(bool)
                -> Where(mask, scores / sqrt(Dh), -10000); attention mask (1 - m) * -10000
    gpt2_nopast the same without a past (the causal mask sliced with the sequence length)
    bert        separate Q/K/V MatMul + Add, K transposed to [B, H, Dh, S] in one Transpose,
                int mask -> Unsqueeze x2 -> Cast(float) -> Sub(1, m) -> Mul(-10000) -> Add
    bert_nocast the mask given as float: no Cast
    distilbert  mask as Where(Equal(mask, 0), -inf-like fill, scores) on a bool mask, scale on Q
`build(kind, path)` writes one; `INPUT_DIMS` documents the symbolic dims.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

HIDDEN, HEADS, MAX_POS = 32, 4, 64
HEAD = HIDDEN // HEADS
KINDS = ("gpt2", "gpt2_nopast", "bert", "bert_nocast", "distilbert")
TOTAL = "past_sequence_length + sequence_length"


class _G:
    """A tiny graph writer: `op(...)` adds a node and returns its output name(s)."""

    def __init__(self, seed: int = 0) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.rng = np.random.default_rng(seed)
        self.n = 0

    def const(self, value, dtype=np.float32) -> str:
        self.n += 1
        name = f"c{self.n}"
        self.inits.append(numpy_helper.from_array(np.asarray(value, dtype), name))
        return name

    def weight(self, *shape: int) -> str:
        return self.const(0.2 * self.rng.standard_normal(shape))

    def op(self, op_type: str, *inputs: str, outputs: int = 1, **attrs):
        self.n += 1
        outs = [f"{op_type.lower()}_{self.n}_{i}" for i in range(outputs)]
        self.nodes.append(
            helper.make_node(op_type, list(inputs), outs, f"{op_type}_{self.n}", **attrs)
        )
        return outs[0] if outputs == 1 else outs

    def heads(self, x: str) -> str:  # [B, S, H*Dh] -> [B, H, S, Dh]
        r = self.op("Reshape", x, self.const([0, 0, HEADS, HEAD], np.int64))
        return self.op("Transpose", r, perm=[0, 2, 1, 3])

    def merge(self, x: str) -> str:  # [B, H, S, Dh] -> [B, S, H*Dh]
        t = self.op("Transpose", x, perm=[0, 2, 1, 3])
        return self.op("Reshape", t, self.const([0, 0, HIDDEN], np.int64))

    def linear(self, x: str, n_out: int) -> str:
        return self.op("Add", self.op("MatMul", x, self.weight(HIDDEN, n_out)), self.weight(n_out))

    def layer_norm(self, x: str) -> str:
        return self.op(
            "LayerNormalization", x, self.weight(HIDDEN), self.weight(HIDDEN), epsilon=1e-5
        )


def _gpt2(g: _G, past: bool) -> tuple[list, list, str]:
    x = g.op("Add", "input_1", "input_2")
    qkv = g.linear(g.layer_norm(x), 3 * HIDDEN)
    q, k, v = g.op("Split", qkv, g.const([HIDDEN] * 3, np.int64), outputs=3, axis=2)
    q, k, v = g.heads(q), g.heads(k), g.heads(v)
    outputs = []
    if past:
        pk, pv = g.op("Split", "past", g.const([1, 1], np.int64), outputs=2, axis=0)
        zero = g.const([0], np.int64)
        k = g.op("Concat", g.op("Squeeze", pk, zero), k, axis=-2)
        v = g.op("Concat", g.op("Squeeze", pv, zero), v, axis=-2)
        present = g.op("Concat", g.op("Unsqueeze", k, zero), g.op("Unsqueeze", v, zero), axis=0)
        g.nodes.append(helper.make_node("Identity", [present], ["present"]))
        outputs.append(
            helper.make_tensor_value_info(
                "present", TensorProto.FLOAT, [2, "batch_size", HEADS, TOTAL, HEAD]
            )
        )
    scores = g.op(
        "Div", g.op("MatMul", q, g.op("Transpose", k, perm=[0, 1, 3, 2])), g.const(math.sqrt(HEAD))
    )
    # causal mask: rows [T - S, T) and columns [0, T) of a uint8 lower-triangular buffer, the
    # lengths read as the generator reads them: Squeeze(Slice(Shape(x), -2, -1))
    first = g.const([0], np.int64)

    def length(x: str) -> str:
        sl = g.op(
            "Slice", g.op("Shape", x), g.const([-2], np.int64), g.const([-1], np.int64), first
        )
        return g.op("Squeeze", sl, first)

    seq, total_len = length(q), length(k)
    start = g.op("Unsqueeze", g.op("Sub", total_len, seq), first)
    total = g.op("Unsqueeze", total_len, first)
    tril = g.const(np.tril(np.ones((MAX_POS, MAX_POS)))[None, None], np.uint8)
    rows = g.op("Slice", tril, start, total, g.const([2], np.int64))
    causal = g.op(
        "Cast",
        g.op("Slice", rows, g.const([0], np.int64), total, g.const([3], np.int64)),
        to=TensorProto.BOOL,
    )
    scores = g.op("Where", causal, scores, g.const(-10000.0))
    m = g.op(
        "Unsqueeze", g.op("Unsqueeze", "input_mask", g.const([1], np.int64)), g.const([2], np.int64)
    )
    scores = g.op("Add", scores, g.op("Mul", g.op("Sub", g.const(1.0), m), g.const(-10000.0)))
    attn = g.op("MatMul", g.op("Softmax", scores, axis=3), v)
    # the output projection as a Gemm over [B*S, D] between Reshapes, then the residual Add and
    # the next LayerNorm: the anchor onnxruntime's GPT-2 fusion starts from
    merged = g.merge(attn)
    flat = g.op("Reshape", merged, g.const([-1, HIDDEN], np.int64))
    gemm = g.op("Gemm", flat, g.weight(HIDDEN, HIDDEN), g.weight(HIDDEN))
    out = g.layer_norm(g.op("Add", g.op("Reshape", gemm, g.op("Shape", merged)), x))
    inputs = [
        helper.make_tensor_value_info(
            "input_1", TensorProto.FLOAT, ["batch_size", "sequence_length", HIDDEN]
        ),
        helper.make_tensor_value_info(
            "input_2", TensorProto.FLOAT, ["batch_size", "sequence_length", HIDDEN]
        ),
        helper.make_tensor_value_info(
            "input_mask", TensorProto.FLOAT, ["batch_size", TOTAL if past else "sequence_length"]
        ),
    ]
    if past:
        inputs.append(
            helper.make_tensor_value_info(
                "past", TensorProto.FLOAT, [2, "batch_size", HEADS, "past_sequence_length", HEAD]
            )
        )
    return inputs, outputs, out


def _bert(g: _G, kind: str) -> tuple[list, list, str]:
    x = "input_1"
    q, k, v = (g.linear(x, HIDDEN) for _ in range(3))
    q, v = g.heads(q), g.heads(v)
    rk = g.op("Reshape", k, g.const([0, 0, HEADS, HEAD], np.int64))
    if kind == "distilbert":
        q = g.op("Div", q, g.const(math.sqrt(HEAD)))
        scores = g.op("MatMul", q, g.op("Transpose", g.heads(k), perm=[0, 1, 3, 2]))
        m = g.op("Reshape", "input_mask", g.const([0, 1, 1, -1], np.int64))
        masked = g.op("Equal", m, g.const(0, np.int64))
        scores = g.op("Where", masked, g.const(float(np.finfo(np.float32).min)), scores)
    else:
        scores = g.op("MatMul", q, g.op("Transpose", rk, perm=[0, 2, 3, 1]))
        scores = g.op("Div", scores, g.const(math.sqrt(HEAD)))
        m = g.op(
            "Unsqueeze",
            g.op("Unsqueeze", "input_mask", g.const([1], np.int64)),
            g.const([2], np.int64),
        )
        if kind == "bert":
            m = g.op("Cast", m, to=TensorProto.FLOAT)
        scores = g.op("Add", scores, g.op("Mul", g.op("Sub", g.const(1.0), m), g.const(-10000.0)))
    attn = g.op("MatMul", g.op("Softmax", scores, axis=-1), v)
    out = g.layer_norm(g.op("Add", x, g.linear(g.merge(attn), HIDDEN)))
    mask_type = TensorProto.FLOAT if kind == "bert_nocast" else TensorProto.INT64
    inputs = [
        helper.make_tensor_value_info(
            "input_1", TensorProto.FLOAT, ["batch_size", "sequence_length", HIDDEN]
        ),
        helper.make_tensor_value_info("input_mask", mask_type, ["batch_size", "sequence_length"]),
    ]
    return inputs, [], out


def build(kind: str, path: Path, opset: int = 17) -> Path:
    """Write the `kind` block (see KINDS) to `path`."""
    g = _G()
    if kind.startswith("gpt2"):
        inputs, outputs, out = _gpt2(g, past=kind == "gpt2")
    else:
        inputs, outputs, out = _bert(g, kind)
    g.nodes.append(helper.make_node("Identity", [out], ["output"]))
    outputs.insert(
        0,
        helper.make_tensor_value_info(
            "output", TensorProto.FLOAT, ["batch_size", "sequence_length", HIDDEN]
        ),
    )
    graph = helper.make_graph(g.nodes, kind, inputs, outputs, g.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path
