"""The EAGLE head's runtime graph, written node by node on onnxruntime's fused operators.

``eagle_head.EagleHead.forward`` exported through TorchScript gives a correct graph of about
120 nodes after onnxruntime's own fusions (RoPE computed from the positions every run, the
grouped-query attention spelled out with Tile / Reshape / Softmax), and a draft run of one
position is mostly the cost of running those small nodes. This module writes the same
function as about 25 nodes: one packed QKV MatMul and onnxruntime's ``GroupQueryAttention``
(rotary from a cos / sin table, causal mask, the KV concatenation) where the exported graph had
76 nodes. Same inputs, outputs and KV layout (concat past in, present out, [B, Hkv, P, Dh]),
so the proposer runs either; ``tests/exporter/test_eagle.py`` checks it against the torch
head. It also takes the attention's lengths (``LENGTH_INPUTS``), which lets the runtime keep
the head's KV in one buffer written in place; ``eagle_lengths.lengths_as_inputs`` gives a
graph written before that (lengths derived from the past's shape) the same inputs when it is
opened.

GroupQueryAttention is an onnxruntime contrib operator (CPU and CUDA kernels); a provider
without it runs the TorchScript graph (``eagle_artifact.DRAFT_FILE``), which the artifact
keeps.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from specport.core.contract import EAGLE_LENGTH_INPUTS
from specport.exporter.eagle_head import INPUTS, OUTPUTS, EagleConfig, EagleHead

CONTRIB = "com.microsoft"
OPSET = 18
# positions past the target's context that a draft can reach (drafts continue after the
# last real position); a chain or tree never drafts this deep
DRAFT_POSITIONS = 64
# GroupQueryAttention's lengths are fed (EAGLE_LENGTH_INPUTS), not derived from the past's
# shape: a past [B, Hkv, T, Dh] may then be a buffer of capacity T bound as the present too
# (``runtime.speculative.eagle_kv``); a concat caller feeds P + S - 1 and P + S
LENGTH_INPUTS = EAGLE_LENGTH_INPUTS


def fusable(cfg: EagleConfig) -> str | None:
    """Why the head cannot run on ``GroupQueryAttention`` (None: it can): the CPU kernel takes
    head sizes in multiples of 16 (every model in the zoo: 64, 80, 96, 128, 256)."""
    if cfg.head_dim % 16:
        return f"head size {cfg.head_dim} is not a multiple of 16"
    if cfg.heads % cfg.kv_heads:
        return f"{cfg.heads} query heads do not share {cfg.kv_heads} KV heads evenly"
    return None


def fused_draft_graph(head: EagleHead, max_positions: int) -> onnx.ModelProto:
    """The head as a graph on ``GroupQueryAttention``; ``max_positions``: the target's
    context length (the rotary table's rows, plus ``DRAFT_POSITIONS``). ValueError when
    ``fusable`` says why not."""
    cfg = head.cfg
    reason = fusable(cfg)
    if reason:
        raise ValueError(f"the draft head cannot use GroupQueryAttention: {reason}")
    h, heads, kv, dh = cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head_dim
    inits: list[onnx.TensorProto] = []
    nodes: list[onnx.NodeProto] = []

    def const(name: str, value: Any, dtype: Any = np.float32) -> str:
        inits.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def linear(name: str, weight: Any) -> str:
        # torch's Linear stores [out, in]; MatMul wants [in, out]
        return const(name, weight.detach().float().numpy().T)

    def node(op: str, inputs: list[str], out: str, domain: str = "", **attrs: Any) -> str:
        nodes.append(helper.make_node(op, inputs, [out], name=out, domain=domain, **attrs))
        return out

    def rms(x: str, norm: Any, name: str) -> str:
        weight = const(f"{name}.weight", norm.weight.detach().float().numpy())
        return node("SimplifiedLayerNormalization", [x, weight], name, axis=-1, epsilon=cfg.eps)

    # u = fc(features) + hidden_in
    fc = node("MatMul", ["features", linear("fc.weight", head.fc.weight)], "fc")
    u = node("Add", [fc, "hidden_in"], "u")
    # x = concat(gain * embed(tok), norm_h(u))
    table = head.embed.detach().half().numpy()  # an input signal only: half the bytes
    emb = node("Gather", [const("embed", table, np.float16), "input_ids"], "embed_rows")
    emb = node("Cast", [emb], "embed_f32", to=TensorProto.FLOAT)
    gain = const("embed_gain", head.embed_gain.detach().float().numpy())
    emb = node("Mul", [emb, gain], "embed_scaled")
    x = node("Concat", [emb, rms(u, head.norm_h, "norm_h")], "x", axis=-1)
    # one packed QKV projection
    qkv_weight = np.concatenate(
        [
            head.q_proj.weight.detach().float().numpy(),
            head.k_proj.weight.detach().float().numpy(),
            head.v_proj.weight.detach().float().numpy(),
        ],
        0,
    ).T
    qkv = node("MatMul", [x, const("qkv.weight", qkv_weight)], "qkv")
    # GroupQueryAttention's lengths are inputs (LENGTH_INPUTS), so the runtime can bind one
    # KV buffer as both past and present and the attention writes the new positions in place
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, dh, 2, dtype=np.float32) / dh))
    angles = np.arange(max_positions + DRAFT_POSITIONS, dtype=np.float32)[:, None] * inv[None, :]
    nodes.append(
        helper.make_node(
            "GroupQueryAttention",
            [
                qkv,
                "",
                "",
                "past_key",
                "past_value",
                *LENGTH_INPUTS,
                const("cos_cache", np.cos(angles)),
                const("sin_cache", np.sin(angles)),
            ],
            ["attention", "present_key", "present_value"],
            name="attention",
            domain=CONTRIB,
            num_heads=heads,
            kv_num_heads=kv,
            do_rotary=1,
            rotary_interleaved=0,
            scale=float(1.0 / np.sqrt(dh)),
        )
    )
    o = node("MatMul", ["attention", linear("o_proj.weight", head.o_proj.weight)], "o_proj")
    hid = node("Add", [u, o], "h")
    m = rms(hid, head.norm_m, "norm_m")
    gate = node("MatMul", [m, linear("gate.weight", head.gate.weight)], "gate")
    silu = node("Mul", [gate, node("Sigmoid", [gate], "gate_sigmoid")], "gate_silu")
    up = node("MatMul", [m, linear("up.weight", head.up.weight)], "up")
    mlp = node(
        "MatMul",
        [node("Mul", [silu, up], "mlp_in"), linear("down.weight", head.down.weight)],
        "down",
    )
    node("Add", [hid, mlp], "hidden_out")
    # only the last position drafts
    g_last = node("Gather", ["hidden_out", const("minus_one", -1, np.int64)], "g_last", axis=1)
    normed = rms(g_last, head.norm_f, "norm_f")
    node("MatMul", [normed, linear("lm_head.weight", head.lm_head.weight)], "draft_logits")
    best = node("ArgMax", ["draft_logits"], "best", axis=-1, keepdims=0)
    draft_ids = const("draft_ids", head.draft_ids.detach().numpy(), np.int64)
    node("Gather", [draft_ids, best], "draft_token")

    f32, i64, i32 = TensorProto.FLOAT, TensorProto.INT64, TensorProto.INT32
    dims = ["batch", "sequence_length"]
    past = ["batch", kv, "past_sequence_length", dh]
    present = ["batch", kv, "total_sequence_length", dh]
    shapes: dict[str, tuple[Any, list[Any]]] = {  # (element type, dims)
        "input_ids": (i64, dims),
        "features": (f32, [*dims, cfg.feature_layers * h]),
        "hidden_in": (f32, [*dims, h]),
        "past_key": (f32, past),
        "past_value": (f32, past),
        "draft_token": (i64, ["batch"]),
        "draft_logits": (f32, ["batch", cfg.draft_vocab]),
        "hidden_out": (f32, [*dims, h]),
        "present_key": (f32, present),
        "present_value": (f32, present),
        LENGTH_INPUTS[0]: (i32, ["batch"]),
        LENGTH_INPUTS[1]: (i32, []),
    }
    graph = helper.make_graph(
        nodes,
        "eagle_draft",
        [helper.make_tensor_value_info(n, *shapes[n]) for n in (*INPUTS, *LENGTH_INPUTS)],
        [helper.make_tensor_value_info(n, *shapes[n]) for n in OUTPUTS],
        inits,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(CONTRIB, 1)]
    )
    model.ir_version = 9
    return model
