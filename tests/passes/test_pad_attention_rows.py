"""PadAttentionRowsPass: every GroupQueryAttention run gets a second valid query row, so a
verify run's attention equals one-token steps' bit for bit (float graphs too), once per graph."""

from __future__ import annotations

import shutil
from pathlib import Path

import onnx_ir as ir
import pytest

from benchmarks.row_invariance import compare
from specport.artifact.files import write_artifact_manifest
from specport.artifact.manifest import DATA_NAME, read_manifest
from specport.passes.pad_attention_rows import PADDED, PadAttentionRowsPass


def _padded_copy(src: Path, dst: Path) -> dict:
    shutil.copytree(src, dst)
    manifest = read_manifest(dst)
    model = ir.load(src / manifest.model_file)
    report = PadAttentionRowsPass()(model).report
    (dst / manifest.model_file).unlink()
    (dst / DATA_NAME).unlink(missing_ok=True)
    ir.save(model, dst / manifest.model_file, external_data=DATA_NAME)
    write_artifact_manifest(dst, manifest)
    return report


@pytest.mark.parametrize("layout", ["concat", "shared", "shared-tree"])
def test_float_attention_becomes_row_invariant(tiny_zoo, tmp_path, layout):
    """Before: GroupQueryAttention is where a verify run first differs from the steps (its
    one-row GEMM path). After: attention and everything it feeds up to the float LM head's
    MatMul (SGEMM, not padded) equal the steps bit for bit, KV included (with a token-tree
    bias and rotary positions too: shared-tree)."""
    if layout == "concat":
        src = tiny_zoo.artifact("llama", fuse=True)
    else:
        src = tiny_zoo.shared("llama", tree_mask=layout == "shared-tree")
    prompt = [1, 5, 6, 7, 8, 9, 10, 11]
    before = compare(src, prompt, tokens=4, threads=1)
    assert "GroupQueryAttention" in {o["op"] for o in before["origins"]}
    report = _padded_copy(src, tmp_path / "padded")
    assert report["modified"] and report["layers"] == 2
    assert report["layout"] == layout.split("-")[0]
    after = compare(tmp_path / "padded", prompt, tokens=4, threads=1)
    assert {o["op"] for o in after["origins"]} <= {"MatMul"}  # the float head only
    assert after["kv_differs"] == []
    assert "GroupQueryAttention" not in after["differs"]


def test_pads_each_attention_once(tiny_zoo):
    manifest = read_manifest(tiny_zoo.shared("llama"))
    model = ir.load(tiny_zoo.shared("llama") / manifest.model_file)
    first = PadAttentionRowsPass()(model)
    nodes = [n for n in model.graph if n.op_type == "GroupQueryAttention"]
    assert first.modified and all(n.metadata_props.get(PADDED) == "1" for n in nodes)
    assert all(n.inputs[16] is not None for n in nodes)  # valid rows go through query_seqlens
    again = PadAttentionRowsPass()(model)
    assert not again.modified and again.report["skipped"] == "attention rows already padded"


def test_graph_without_attention_is_skipped():
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    model = ir.serde.deserialize_model(helper.make_model(graph))
    result = PadAttentionRowsPass()(model)
    assert (
        not result.modified and "no com.microsoft GroupQueryAttention" in result.report["skipped"]
    )
