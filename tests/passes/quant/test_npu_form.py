"""`specport quantize --form npu` (passes/quant/npu.py): an artifact quantized to QDQ with
uint16 activations scores like its float source and records its recipe."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from specport.core.errors import QuantizationError
from specport.passes.quant.apply import quantize_artifact
from specport.passes.quant.npu import late_position_feeds
from specport.runtime.eval import perplexity


@pytest.mark.slow
@pytest.mark.parametrize(("scheme", "tolerance"), [("w8a16", 0.02), ("w4a16", 0.3)])
def test_npu_form_artifact(quant_src, calib_text, eval_text, tmp_path, scheme, tolerance):
    out = tmp_path / scheme
    m = quantize_artifact(quant_src, out, scheme, 32, "default", [calib_text], form="npu")
    q = m.quant or {}
    assert q["form"] == "npu" and q["activation_dtype"] == "uint16" and q["symmetric"]
    assert q["ort_session_config"] == {"session.qdq_matmulnbits_accuracy_level": "0"}
    assert q["group_size"] == 0  # per output channel: what the HTP backend computes right
    proto = onnx.load(str(out / m.model_file), load_external_data=False)
    ops = {n.op_type for n in proto.graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops
    assert not any(
        n.domain == "com.microsoft" and n.op_type == "MatMulNBits" for n in proto.graph.node
    )
    zeros = {i.data_type for i in proto.graph.initializer if i.name.endswith(".qzero")}
    assert zeros == {onnx.TensorProto.UINT16}
    ppl = perplexity(out, eval_text)["ppl"]
    base = perplexity(quant_src, eval_text)["ppl"]
    assert ppl < base * (1 + tolerance), (ppl, base)


def test_npu_form_needs_no_calibration_text_but_a_weight_only_scheme(quant_src, tmp_path):
    with pytest.raises(QuantizationError, match="not a w8a8 form"):
        quantize_artifact(quant_src, tmp_path / "o", "w8a8", 32, "default", [], form="npu")


def test_late_position_feed_reaches_the_context_end():
    feeds = [{"input_ids": np.zeros((1, 5), np.int64), "position_ids": np.arange(5)[None]}]
    late = late_position_feeds(feeds, 512)
    assert late[0]["position_ids"].tolist() == [list(range(507, 512))]
    assert late_position_feeds(feeds, 5) == []
