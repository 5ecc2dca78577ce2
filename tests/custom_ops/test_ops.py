"""Every specport op: function body, cpu lowering and cann inlining against the numpy reference."""

from __future__ import annotations

import numpy as np
import pytest

from specport.core.errors import PassError, ProviderError
from specport.custom_ops import REGISTRY
from specport.custom_ops import torch_npu as npu
from specport.custom_ops.cann import check_ops
from specport.custom_ops.lowering import lower_model
from specport.custom_ops.testing import run, single_op_model
from specport.passes.base import op_counts

TARGETS = ["neutral", "cpu", "cann"]


def _rng():
    return np.random.default_rng(0)


def _norm_case(op):
    rng = _rng()
    x = rng.standard_normal((2, 5, 32), dtype=np.float32)
    skip = rng.standard_normal((2, 5, 32), dtype=np.float32)
    w = rng.standard_normal(32, dtype=np.float32)
    b = rng.standard_normal(32, dtype=np.float32)
    if op == "RMSNorm":
        return {"x": x, "w": w}, 1, {"epsilon": 1e-5}, REGISTRY[op].reference(x, w, 1e-5)
    if op == "SkipRMSNorm":
        feeds = {"x": x, "s": skip, "w": w}
        return feeds, 2, {"epsilon": 1e-5}, REGISTRY[op].reference(x, skip, w, 1e-5)
    feeds = {"x": x, "s": skip, "g": w, "b": b}
    return feeds, 2, {"epsilon": 1e-5}, REGISTRY[op].reference(x, skip, w, b, 1e-5)


@pytest.mark.parametrize(
    ("option", "ops"),
    [
        ({}, {"Add", "LayerNormalization"}),  # the cpu default: faster than the contrib kernel
        ({"skip_layer_norm": "contrib"}, {"com.microsoft.SkipLayerNormalization"}),
    ],
    ids=["standard", "contrib"],
)
def test_skip_layer_norm_cpu_lowerings(option, ops):
    feeds, n_out, attrs, ref = _norm_case("SkipLayerNorm")
    model = single_op_model("SkipLayerNorm", feeds, n_out, attrs)
    lower_model(model, "cpu", **option)
    assert set(op_counts(model)) == ops
    for got, want in zip(run(model, feeds), ref):
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("op", ["RMSNorm", "SkipRMSNorm", "SkipLayerNorm"])
def test_norms(op, target):
    feeds, n_out, attrs, ref = _norm_case(op)
    model = single_op_model(op, feeds, n_out, attrs)
    lower_model(model, target)
    if target != "neutral":
        assert not any(k.startswith("specport.") for k in op_counts(model))
    outs = run(model, feeds)
    refs = ref if isinstance(ref, tuple) else (ref,)
    for got, want in zip(outs, refs):
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("rot", [16, 8])  # full and partial rotary (Dh = 16)
def test_rotary(target, rot):
    rng = _rng()
    x = rng.standard_normal((2, 4, 3, 16), dtype=np.float32)
    cos = rng.standard_normal((2, 3, rot // 2), dtype=np.float32)
    sin = rng.standard_normal((2, 3, rot // 2), dtype=np.float32)
    feeds = {"x": x, "cos": cos, "sin": sin}
    model = single_op_model("RotaryEmbedding", feeds, 1)
    # give the lowering the static shapes the exported graph would have
    model.graph.inputs[0].shape = __import__("onnx_ir").Shape(["B", 4, "S", 16])
    model.graph.inputs[1].shape = __import__("onnx_ir").Shape(["B", "S", rot // 2])
    lower_model(model, target)
    got = run(model, feeds)[0]
    np.testing.assert_allclose(got, REGISTRY["RotaryEmbedding"].reference(x, cos, sin), atol=1e-5)


GQA_CASES = [
    # B, H, Hkv, S, P, left pads, window, softcap
    (2, 8, 8, 1, 7, [0, 3], 0, 0.0),  # MHA decode, padded row
    (2, 8, 4, 3, 5, [0, 2], 0, 0.0),  # GQA ratio 2, multi-token on a past, batch 2
    (3, 4, 2, 4, 6, [0, 5, 2], 4, 0.0),  # batch 3, multi-token on a past, sliding window
    (2, 8, 1, 1, 9, [1, 0], 0, 0.0),  # MQA (ratio 8)
    (2, 4, 2, 6, 0, [0, 2], 0, 0.0),  # prefill, past 0, padding
    (1, 4, 2, 5, 9, [0], 4, 0.0),  # sliding window, multi-token
    (2, 4, 2, 1, 9, [0, 2], 4, 0.0),  # sliding window decode
    (2, 4, 2, 1, 9, [0, 2], 0, 1.0),  # soft-capped scores (Gemma 2), decode
    (1, 4, 2, 5, 9, [0], 4, 1.0),  # soft-capping with a sliding window, multi-token
    (2, 4, 2, 6, 0, [0, 2], 0, 1.0),  # soft-capped prefill with padding
]


def _gqa_id(c: tuple) -> str:
    return "-".join(map(str, c[:5])) + f"-w{c[6]}" + (f"-cap{c[7]:g}" if c[7] else "")


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("case", GQA_CASES, ids=_gqa_id)
def test_group_query_attention(case, target):
    b, h, hkv, s, p, pads, window, softcap = case
    rng = _rng()
    d = 16

    def r(*shape):
        return rng.standard_normal(shape, dtype=np.float32)

    feeds = {
        "q": r(b, h, s, d),
        "k": r(b, hkv, s, d),
        "v": r(b, hkv, s, d),
        "pk": r(b, hkv, p, d),
        "pv": r(b, hkv, p, d),
        "mask": np.ones((b, p + s), np.int64),
    }
    for i, n in enumerate(pads):
        feeds["mask"][i, :n] = 0
    attrs = {"scale": 0.3, "sliding_window": window, "num_heads": h, "kv_num_heads": hkv}
    if softcap:
        attrs["softcap"] = softcap
    model = single_op_model("GroupQueryAttention", feeds, 3, attrs)
    lower_model(model, target)
    counts = op_counts(model)
    if target == "cpu":  # the fused kernel runs every shape (query_seqlens), no fallback
        assert counts.get("com.microsoft.GroupQueryAttention") == 1
        assert "If" not in counts
    out, pk, pv = run(model, feeds)
    ref = REGISTRY["GroupQueryAttention"].reference(
        *feeds.values(), scale=0.3, sliding_window=window, softcap=softcap
    )
    real = feeds["mask"][:, p:] == 1  # rows of real query tokens [B, S]
    diff = np.abs(out - ref[0]).max(axis=(1, 3))
    assert diff[real].max() < 2e-5
    np.testing.assert_array_equal(pk, ref[1])
    np.testing.assert_array_equal(pv, ref[2])


def test_cann_lowering_has_only_standard_ops():
    feeds, n_out, attrs, _ = _norm_case("SkipRMSNorm")
    model = single_op_model("SkipRMSNorm", feeds, n_out, attrs)
    report = lower_model(model, "cann")
    assert report["cann"]["ok"], report
    assert report["cann"]["npu_fraction"] > 0.5
    assert check_ops(model)["forbidden"] == {}


def test_unknown_target():
    feeds, n_out, attrs, _ = _norm_case("RMSNorm")
    with pytest.raises(PassError, match="unknown target"):
        lower_model(single_op_model("RMSNorm", feeds, n_out, attrs), "tpu")


def test_torch_npu_table():
    if not npu.available():
        with pytest.raises(ProviderError, match="torch_npu"):
            npu.kernel_table()
        pytest.skip("torch_npu not installed: only the clear error is checked")
    assert npu.kernel_table()["GroupQueryAttention"].endswith("npu_fused_infer_attention_score")
