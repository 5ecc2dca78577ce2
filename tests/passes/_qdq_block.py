"""A one-layer Llama-style block in standard opset-23 ops with static shapes (batch 1,
sequence S, no KV cache): the smallest graph with every op kind an NPU artifact carries
(Gather, RMSNormalization, MatMul, RotaryEmbedding, Attention, Sigmoid, Mul, Add)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN = 64, 32, 4, 2, 8, 64


def build_block(seq: int = 8, seed: int = 0) -> onnx.ModelProto:
    """ids [1, S] int64, position_ids [1, S] int64 -> logits [1, S, VOCAB] float."""
    rng = np.random.default_rng(seed)

    def w(name: str, *shape: int, scale: float = 0.2) -> onnx.TensorProto:
        return numpy_helper.from_array(
            (rng.standard_normal(shape) * scale).astype(np.float32), name
        )

    half = HEAD_DIM // 2
    inv = 1.0 / (10000 ** (np.arange(half) / half))
    ang = np.arange(64)[:, None] * inv[None, :]
    inits = [
        w("embed", VOCAB, HIDDEN, scale=1.0),
        numpy_helper.from_array((1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32), "g1"),
        numpy_helper.from_array((1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32), "g2"),
        numpy_helper.from_array((1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32), "g3"),
        w("wq", HIDDEN, HEADS * HEAD_DIM),
        w("wk", HIDDEN, KV_HEADS * HEAD_DIM),
        w("wv", HIDDEN, KV_HEADS * HEAD_DIM),
        w("wo", HEADS * HEAD_DIM, HIDDEN),
        w("wg", HIDDEN, FFN),
        w("wu", HIDDEN, FFN),
        w("wd", FFN, HIDDEN),
        w("head", HIDDEN, VOCAB),
        numpy_helper.from_array(np.cos(ang).astype(np.float32), "cos"),
        numpy_helper.from_array(np.sin(ang).astype(np.float32), "sin"),
        numpy_helper.from_array(np.array([1, seq, HEADS, HEAD_DIM], np.int64), "shape_q"),
        numpy_helper.from_array(np.array([1, seq, KV_HEADS, HEAD_DIM], np.int64), "shape_kv"),
        numpy_helper.from_array(np.array([1, seq, HEADS * HEAD_DIM], np.int64), "shape_o"),
    ]
    n = helper.make_node
    nodes = [
        n("Gather", ["embed", "input_ids"], ["h0"]),
        n("RMSNormalization", ["h0", "g1"], ["x1"], axis=-1, epsilon=1e-5),
        n("MatMul", ["x1", "wq"], ["q"]),
        n("MatMul", ["x1", "wk"], ["k"]),
        n("MatMul", ["x1", "wv"], ["v"]),
        n("Reshape", ["q", "shape_q"], ["q4"]),
        n("Reshape", ["k", "shape_kv"], ["k4"]),
        n("Reshape", ["v", "shape_kv"], ["v4"]),
        n("Transpose", ["q4"], ["q4t"], perm=[0, 2, 1, 3]),
        n("Transpose", ["k4"], ["k4t"], perm=[0, 2, 1, 3]),
        n("RotaryEmbedding", ["q4t", "cos", "sin", "position_ids"], ["qt"]),
        n("RotaryEmbedding", ["k4t", "cos", "sin", "position_ids"], ["kt"]),
        n("Transpose", ["v4"], ["vt"], perm=[0, 2, 1, 3]),
        n("Attention", ["qt", "kt", "vt"], ["att"], is_causal=1),
        n("Transpose", ["att"], ["att_t"], perm=[0, 2, 1, 3]),
        n("Reshape", ["att_t", "shape_o"], ["att_f"]),
        n("MatMul", ["att_f", "wo"], ["o"]),
        n("Add", ["h0", "o"], ["h1"]),
        n("RMSNormalization", ["h1", "g2"], ["x2"], axis=-1, epsilon=1e-5),
        n("MatMul", ["x2", "wg"], ["gate"]),
        n("MatMul", ["x2", "wu"], ["up"]),
        n("Sigmoid", ["gate"], ["sg"]),
        n("Mul", ["gate", "sg"], ["silu"]),
        n("Mul", ["silu", "up"], ["act"]),
        n("MatMul", ["act", "wd"], ["down"]),
        n("Add", ["h1", "down"], ["h2"]),
        n("RMSNormalization", ["h2", "g3"], ["x3"], axis=-1, epsilon=1e-5),
        n("MatMul", ["x3", "head"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes,
        "block",
        [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, seq]),
            helper.make_tensor_value_info("position_ids", TensorProto.INT64, [1, seq]),
        ],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, seq, VOCAB])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    model.ir_version = 10
    return model


def block_feeds(n: int, seq: int = 8, seed: int = 1) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    pos = np.arange(seq, dtype=np.int64)[None]
    return [
        {"input_ids": rng.integers(0, VOCAB, (1, seq)).astype(np.int64), "position_ids": pos}
        for _ in range(n)
    ]
