"""QuantizeQDQPass (passes/quant/qdq.py): the NPU QDQ form on a one-layer standard-op block.

What users rely on: the quantized graph computes what the float graph computes (within the
stated tolerances), it holds only ops the QNN HTP backend accepts, every op between them sees
quantized inputs, and it runs entirely on the HTP emulator with CPU fallback disabled.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from specport.passes.quant.qdq import (
    QuantizeQDQPass,
    activation_qparams,
    collect_ranges,
    merge_ranges,
    quantize_symmetric,
)
from tests.passes._qdq_block import block_feeds, build_block

WEIGHTS = ("wq", "wk", "wv", "wo", "wg", "wu", "wd", "head")
# What the HTP backend took in this block with session.disable_cpu_ep_fallback=1 (soc 60).
HTP_OPS = {
    "QuantizeLinear",
    "DequantizeLinear",
    "Gather",
    "RMSNormalization",
    "MatMul",
    "Reshape",
    "Transpose",
    "RotaryEmbedding",
    "Attention",
    "Add",
    "Mul",
    "Sigmoid",
}
VARIANTS = {
    "w8a16": {"weight_bits": 8},
    "w4a16-channel": {"weight_bits": 4},
    "w4a16-block16": {"weight_bits": 4, "block_size": 16},
    "w4a16-matmulnbits": {"weight_bits": 4, "block_size": 16, "weight_form": "matmulnbits"},
}


def _cpu(proto: onnx.ModelProto) -> ort.InferenceSession:
    so = ort.SessionOptions()
    # Else onnxruntime's CPU optimizer turns DQ->MatMul into int8-activation MatMulNBits.
    so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "0")
    return ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _fake_quant_weights(proto: onnx.ModelProto, bits: int, block: int) -> onnx.ModelProto:
    """The float block with each weight replaced by its dequantized codes."""
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    for init in out.graph.initializer:
        if init.name in WEIGHTS:
            w = numpy_helper.to_array(init)
            q, s = quantize_symmetric(w, bits, block)
            deq = q * (s if block <= 0 else np.repeat(s, block, axis=0)[: w.shape[0]])
            init.CopyFrom(numpy_helper.from_array(deq.astype(np.float32), init.name))
    return out


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(a).max())


@pytest.fixture(scope="module")
def block() -> dict[str, Any]:
    proto = build_block()
    test = block_feeds(2, seed=5)
    ranges = collect_ranges(proto, block_feeds(8) + test)
    return {"proto": proto, "test": test, "ranges": ranges}


def _quantize(block: dict[str, Any], **cfg: Any) -> tuple[onnx.ModelProto, dict[str, Any]]:
    model = ir.from_proto(block["proto"])
    result = QuantizeQDQPass(block["ranges"], **cfg)(model)
    assert result.modified
    return ir.to_proto(model), result.report


@pytest.mark.parametrize("variant", VARIANTS)
def test_qdq_numbers_match_float(block: dict[str, Any], variant: str) -> None:
    """uint16 activations add < 2e-3 (relative to the largest logit) to the float graph with
    the same (dequantized) weights, calibrated on it; against fp32 weights the error is the
    weights' own."""
    cfg = VARIANTS[variant]
    deq = _fake_quant_weights(block["proto"], cfg["weight_bits"], cfg.get("block_size", 0))
    # Ranges of the graph that runs (4-bit weights move the activations out of fp32's ranges).
    model = ir.from_proto(block["proto"])
    QuantizeQDQPass(collect_ranges(deq, block_feeds(8) + block["test"]), **cfg)(model)
    qdq = ir.to_proto(model)
    ref = _cpu(deq)
    fp32 = _cpu(block["proto"])
    sess = _cpu(qdq)
    for feed in block["test"]:
        got = sess.run(None, feed)[0]
        assert _rel(ref.run(None, feed)[0], got) < 2e-3
        # Random weights in a one-layer block: int8 per channel ~2%, int4 much more.
        assert _rel(fp32.run(None, feed)[0], got) < (0.05 if cfg["weight_bits"] == 8 else 0.4)


@pytest.mark.parametrize("variant", VARIANTS)
def test_qdq_graph_holds_htp_ops_only(block: dict[str, Any], variant: str) -> None:
    qdq, report = _quantize(block, **VARIANTS[variant])
    ops = {
        n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}.{n.op_type}"
        for n in qdq.graph.node
    }
    allowed = HTP_OPS | {"com.microsoft.MatMulNBits"} if "matmulnbits" in variant else HTP_OPS
    assert ops <= allowed, ops - allowed
    assert report["unquantized"] == 0
    # Every compute op reads only quantized (DQ) float inputs and writes into a Q.
    producers = {o: n for n in qdq.graph.node for o in n.output}
    inits = {i.name for i in qdq.graph.initializer}
    for node in qdq.graph.node:
        if node.op_type in ("QuantizeLinear", "DequantizeLinear"):
            continue
        for name in node.input:
            if name and name not in inits and name in producers:
                assert producers[name].op_type == "DequantizeLinear", (node.name, name)
        consumers = [n.op_type for n in qdq.graph.node if node.output[0] in n.input]
        assert consumers and set(consumers) == {"QuantizeLinear"}, (node.name, consumers)
    dtypes = {i.data_type for i in qdq.graph.initializer if i.name.endswith(".qzero")}
    assert dtypes == {onnx.TensorProto.UINT16}


def test_weights_symmetric_per_channel(block: dict[str, Any]) -> None:
    qdq, report = _quantize(block, weight_bits=8)
    inits = {i.name: numpy_helper.to_array(i) for i in qdq.graph.initializer}
    q, zero = inits["wq.wq"], inits["wq.wq_zero"]
    assert q.dtype == np.int8 and q.min() >= -127 and zero.shape == (q.shape[1],)
    assert not zero.any()
    assert report["layers"]["head"] == {
        "bits": 8,
        "activation_bits": 16,
        "symmetric": True,
        "granularity": "per_channel",
        "lm_head": True,
    }


def test_activation_qparams_keep_zero_exact() -> None:
    scale, zp = activation_qparams(-1.0, 3.0, 65535)
    assert abs(scale - 4.0 / 65535) < 1e-12
    assert zp * scale == pytest.approx(1.0, rel=1e-4)
    assert activation_qparams(0.5, 2.0, 65535)[1] == 0  # range widened to include 0


def test_merge_ranges_takes_the_union() -> None:
    merged = merge_ranges({"a": (-1.0, 1.0)}, {"a": (-2.0, 0.5), "b": (0.0, 3.0)})
    assert merged == {"a": (-2.0, 1.0), "b": (0.0, 3.0)}


def test_missing_range_stays_float_and_is_reported(block: dict[str, Any]) -> None:
    ranges = dict(block["ranges"])
    del ranges["gate"]
    model = ir.from_proto(block["proto"])
    report = QuantizeQDQPass(ranges)(model).report
    assert report["unquantized"] == 1 and report["unquantized_names"] == ["gate"]


def test_precondition_refuses_a_quantized_graph(block: dict[str, Any]) -> None:
    qdq, _ = _quantize(block, weight_bits=8)
    result = QuantizeQDQPass(block["ranges"])(ir.from_proto(qdq))
    assert not result.modified and "already quantized" in result.report["skipped"]
    assert (
        "no calibrated ranges"
        in QuantizeQDQPass({})(ir.from_proto(block["proto"])).report["skipped"]
    )


def _htp_session(proto: onnx.ModelProto) -> ort.InferenceSession:
    from specport.core.ep_plugins import devices

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    so.add_provider_for_devices(devices("qnn"), {"backend_type": "htp", "soc_model": "60"})
    return ort.InferenceSession(proto.SerializeToString(), sess_options=so)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["w8a16", "w4a16-channel"])  # what `--form npu` emits
def test_runs_on_the_htp_emulator_without_cpu_fallback(block: dict[str, Any], variant: str) -> None:
    pytest.importorskip(
        "onnxruntime_qnn", reason="onnxruntime-qnn (the QNN HTP emulator) is not installed"
    )
    qdq, _ = _quantize(block, **VARIANTS[variant])
    htp = _htp_session(qdq)  # raises if any node would need the CPU provider
    cpu = _cpu(qdq)
    feed = block["test"][0]
    # HTP computes in its own integer kernels (requantizing inside fused ops): measured
    # 0.1-2% of the largest logit against the same graph on the CPU provider.
    assert _rel(cpu.run(None, feed)[0], htp.run(None, feed)[0]) < 0.04


def test_position_derived_tensors_stay_float_when_asked() -> None:
    """cos(position * inv_freq) built in the graph: kept float (its range is the context
    window, not the text), inv_freq with it; the data path is still quantized."""
    from onnx import TensorProto, helper

    n = helper.make_node
    graph = helper.make_graph(
        [
            n("Cast", ["position_ids"], ["pos"], to=TensorProto.FLOAT),
            n("Mul", ["pos", "inv_freq"], ["angle"]),
            n("Cos", ["angle"], ["cos"]),
            n("Mul", ["x", "cos"], ["xc"]),
            n("MatMul", ["xc", "w"], ["y"]),
        ],
        "rope",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8]),
            helper.make_tensor_value_info("position_ids", TensorProto.INT64, [1, 4, 1]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8])],
        [
            numpy_helper.from_array((1e-4 ** (np.arange(8) / 8)).astype(np.float32), "inv_freq"),
            numpy_helper.from_array(np.eye(8, dtype=np.float32), "w"),
        ],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    feeds = [
        {
            "x": np.random.default_rng(i).standard_normal((1, 4, 8)).astype(np.float32),
            "position_ids": np.arange(4, dtype=np.int64).reshape(1, 4, 1) + 100 * i,
        }
        for i in range(3)
    ]
    ranges = collect_ranges(proto, feeds)
    model = ir.from_proto(proto)
    report = QuantizeQDQPass(ranges, keep_float_from=["position_ids"])(model).report
    out = ir.to_proto(model)
    quantized = {n.input[0] for n in out.graph.node if n.op_type == "QuantizeLinear"}
    assert not quantized & {"pos", "angle", "cos"} and {"x", "xc"} <= quantized
    assert "inv_freq" in {i.name for i in out.graph.initializer}  # still float, still read
    assert report["kept_float"] == 3
    got = _cpu(out).run(None, feeds[2])[0]
    want = _cpu(proto).run(None, feeds[2])[0]
    assert _rel(want, got) < 1e-3
