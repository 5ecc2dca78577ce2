# mypy: disable-error-code="arg-type,type-var"
# (onnxscript functions: ONNX types, not Python types)
"""specport.GroupQueryAttention: causal MHA/GQA/MQA over a concatenated KV cache.

Contract (heads-first layout, as the exported graph has it after RoPE):
    GroupQueryAttention(query [B, H, S, Dh], key [B, Hkv, S, Dh], value [B, Hkv, S, Dv],
                        past_key [B, Hkv, P, Dh], past_value [B, Hkv, P, Dv],
                        attention_mask int64 [B, P+S]; scale, sliding_window,
                        num_heads, kv_num_heads, softcap)
        -> (output [B, H, S, Dv], present_key [B, Hkv, P+S, Dh], present_value [B, Hkv, P+S, Dv])
    H % Hkv == 0 (Hkv == H: MHA, Hkv == 1: MQA). Query i sits at absolute slot P+i and sees key
    slot j iff j <= P+i, attention_mask[b, j] == 1, and (sliding_window <= 0 or P+i-j < window).
    softcap > 0 caps the scaled scores as softcap * tanh(scores / softcap) before masking
    (Gemma 2; onnxruntime's kernel and ONNX Attention-23 define it the same way).
    Rows with nothing visible (left-pad queries) get a uniform softmax instead of NaN.

Why the mask is an input and not a bias: it keeps the spine I/O contract (`attention_mask`
[B, P+S], 1 = real, 0 = left pad), so the runtime feeds a fused graph exactly like the plain
one. Lowerings: cpu/cuda -> com.microsoft GroupQueryAttention (seqlens_k / total_sequence_length
derived in-graph from the mask, padding via attention_bias); cann -> function body;
torch_npu -> torch_npu.npu_fused_infer_attention_score.
"""

from __future__ import annotations

import numpy as np
from onnxscript import opset23 as op
from onnxscript import script

from specport.custom_ops._base import OPSET, CustomOp, register

NEG = -3.4028234663852886e38


def gqa_reference(
    query: np.ndarray,
    key: np.ndarray,
    value: np.ndarray,
    past_key: np.ndarray,
    past_value: np.ndarray,
    attention_mask: np.ndarray,
    scale: float | None = None,
    sliding_window: int = 0,
    softcap: float = 0.0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    _b, h, s, dh = query.shape
    hkv = key.shape[1]
    pk = np.concatenate([past_key, key], axis=2)
    pv = np.concatenate([past_value, value], axis=2)
    t = pk.shape[2]
    g = h // hkv
    k = np.repeat(pk, g, axis=1).astype(np.float64)
    v = np.repeat(pv, g, axis=1).astype(np.float64)
    scale = scale if scale else 1.0 / np.sqrt(dh)
    scores = np.einsum("bhsd,bhtd->bhst", query.astype(np.float64), k) * scale
    if softcap > 0:
        scores = softcap * np.tanh(scores / softcap)
    qpos = np.arange(t - s, t)[:, None]
    kpos = np.arange(t)[None, :]
    allowed = kpos <= qpos
    if sliding_window > 0:
        allowed &= (qpos - kpos) < sliding_window
    allowed = allowed[None, None] & (attention_mask[:, None, None, :] == 1)
    scores = np.where(allowed, scores, NEG)
    scores -= scores.max(-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(-1, keepdims=True)
    out = np.einsum("bhst,bhtd->bhsd", p, v)
    return out.astype(query.dtype), pk, pv


@script(OPSET, default_opset=op)
def GroupQueryAttention(
    query,
    key,
    value,
    past_key,
    past_value,
    attention_mask,
    scale: float,
    sliding_window: int = 0,
    num_heads: int = 0,
    kv_num_heads: int = 0,
    softcap: float = 0.0,
):
    # num_heads / kv_num_heads are informative (read by the lowerings); the body infers them.
    present_key = op.Concat(past_key, key, axis=2)
    present_value = op.Concat(past_value, value, axis=2)
    qshape = op.Shape(query)
    kshape = op.Shape(present_key)
    vshape = op.Shape(present_value)
    b = op.Slice(qshape, op.Constant(value_ints=[0]), op.Constant(value_ints=[1]))
    h = op.Slice(qshape, op.Constant(value_ints=[1]), op.Constant(value_ints=[2]))
    s = op.Slice(qshape, op.Constant(value_ints=[2]), op.Constant(value_ints=[3]))
    hkv = op.Slice(kshape, op.Constant(value_ints=[1]), op.Constant(value_ints=[2]))
    t = op.Slice(kshape, op.Constant(value_ints=[2]), op.Constant(value_ints=[3]))
    dk = op.Slice(kshape, op.Constant(value_ints=[3]), op.Constant(value_ints=[4]))
    dv = op.Slice(vshape, op.Constant(value_ints=[3]), op.Constant(value_ints=[4]))
    g = op.Div(h, hkv)
    two = op.Constant(value_ints=[2])
    k5 = op.Expand(op.Unsqueeze(present_key, two), op.Concat(b, hkv, g, t, dk, axis=0))
    v5 = op.Expand(op.Unsqueeze(present_value, two), op.Concat(b, hkv, g, t, dv, axis=0))
    k = op.Reshape(k5, op.Concat(b, h, t, dk, axis=0))
    v = op.Reshape(v5, op.Concat(b, h, t, dv, axis=0))
    scores = op.MatMul(query, op.Transpose(k, perm=[0, 1, 3, 2]))
    scores = op.Mul(scores, op.CastLike(op.Constant(value_float=scale), scores))
    cap = op.CastLike(op.Constant(value_float=softcap), scores)
    capped = op.Mul(op.Tanh(op.Div(scores, cap)), cap)  # unused (and inf/nan) when cap == 0
    scores = op.Where(
        op.Greater(cap, op.CastLike(op.Constant(value_float=0.0), cap)), capped, scores
    )
    # Visibility mask [B, 1, S, T]: causal (bottom-right aligned), window, padding.
    t0 = op.Squeeze(t)
    s0 = op.Squeeze(s)
    one = op.Constant(value_int=1)
    qpos = op.Unsqueeze(op.Range(op.Sub(t0, s0), t0, one), op.Constant(value_ints=[1]))
    kpos = op.Unsqueeze(op.Range(op.Constant(value_int=0), t0, one), op.Constant(value_ints=[0]))
    dist = op.Sub(qpos, kpos)  # [S, T]
    window = op.Constant(value_int=sliding_window)
    zero = op.Constant(value_int=0)
    in_window = op.Or(op.LessOrEqual(window, zero), op.Less(dist, window))
    visible = op.And(op.GreaterOrEqual(dist, zero), in_window)
    real = op.Equal(attention_mask, op.CastLike(one, attention_mask))
    real = op.Unsqueeze(real, op.Constant(value_ints=[1, 2]))  # [B, 1, 1, T]
    allowed = op.And(visible, real)
    neg = op.CastLike(op.Constant(value_float=-3.4028234663852886e38), scores)
    probs = op.Softmax(op.Where(allowed, scores, neg), axis=-1)
    return op.MatMul(probs, v), present_key, present_value


GROUP_QUERY_ATTENTION = register(
    CustomOp(
        "GroupQueryAttention",
        GroupQueryAttention,
        gqa_reference,
        {
            "cpu": "com.microsoft.GroupQueryAttention",
            "cann": "function body",
            "torch_npu": "npu_fused_infer_attention_score",
        },
    )
)
