"""`specport optimize` on graphs shaped like onnxruntime's transformer-fusion test data.

What users rely on: a graph that onnxruntime loads and runs is accepted, even with the blemishes
onnx's checker refuses (outputs or value_info without a type, stale shapes, opset 11); its
attention fuses (GPT-2 with and without past, Megatron's multiplicative mask, a BERT-style MHA
block); and the output is checked against onnxruntime running the *input* on random inputs.
What onnxruntime cannot load, or an output that does not match, is refused in one line with
nothing written. The graphs are built here (tests/passes/ort_shaped_graphs.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from specport.cli import main
from tests.passes import ort_shaped_graphs as graphs


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(kind, blemish) -> path, each built once per module."""
    root = tmp_path_factory.mktemp("ort_shaped")
    cache: dict[tuple[str, str | None], Path] = {}

    def get(kind: str, blemish: str | None = "typeless_outputs") -> Path:
        if (kind, blemish) not in cache:
            cache[kind, blemish] = graphs.build(kind, root / f"{kind}-{blemish}.onnx", blemish)
        return cache[kind, blemish]

    return get


def _optimize(src: Path, out: Path, capsys) -> dict:
    capsys.readouterr()
    assert main(["optimize", str(src), "--out", str(out), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _ops(path: Path) -> dict[str, int]:
    counts: dict[str, int] = {}
    for n in onnx.load(str(path), load_external_data=False).graph.node:
        key = f"{n.domain}.{n.op_type}" if n.domain else n.op_type
        counts[key] = counts.get(key, 0) + 1
    return counts


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind, op",
    [
        ("gpt2_past", "com.microsoft.GroupQueryAttention"),
        ("gpt2_megatron", "com.microsoft.GroupQueryAttention"),
        ("gpt2_nopast", "Attention"),
        ("mha_block", "Attention"),
    ],
)
def test_checker_refused_graphs_fuse_and_match_onnxruntime(built, tmp_path, capsys, kind, op):
    src = built(kind)
    with pytest.raises(onnx.checker.ValidationError, match="type"):
        onnx.checker.check_model(str(src))  # what the old loader refused on
    info = _optimize(src, tmp_path / "o.onnx", capsys)
    assert any("graph outputs without a type" in r for r in info["repairs"])
    if kind == "gpt2_past":  # exported at opset 11
        assert any("upgraded opset 11" in r for r in info["repairs"])
    attn = next(p for p in info["passes"] if p["name"] == "fuse_attention")
    assert attn["attention_nodes"] == 1 and attn["softmax_left"] == 0
    assert _ops(tmp_path / "o.onnx").get(op) == 1 and "Softmax" not in _ops(tmp_path / "o.onnx")
    parity = info["parity"]
    assert parity["checked"] and parity["max_abs_error"] < 1e-4
    # and independently of the command's own check: logits match on a fresh random input
    feeds = {
        "input_ids": np.array([[5, 9, 1]], np.int64),
        "position_ids": np.array([[2, 3, 4]], np.int64),
        "attention_mask": np.ones((1, 5), np.int64),
    }
    if kind in ("gpt2_nopast", "mha_block"):
        feeds["attention_mask"] = np.ones((1, 3), np.int64)
        feeds["position_ids"] = np.array([[0, 1, 2]], np.int64)
    else:
        feeds["past_0"] = np.random.default_rng(1).standard_normal((2, 1, 4, 2, 8), np.float32)
    want = ort.InferenceSession(str(src)).run(None, feeds)
    got = ort.InferenceSession(str(tmp_path / "o.onnx")).run(None, feeds)
    for a, b in zip(want, got):
        np.testing.assert_allclose(a, b, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("blemish", ["typeless_value_info", "stale_shapes"])
def test_blemishes_are_repaired_and_reported(built, tmp_path, capsys, blemish):
    src = built("gpt2_nopast", blemish)
    info = _optimize(src, tmp_path / "o.onnx", capsys)
    want = {"typeless_value_info": "without a type", "stale_shapes": "stale shape annotations"}
    assert any(want[blemish] in r for r in info["repairs"]), info["repairs"]
    assert info["parity"]["checked"] and info["parity"]["max_abs_error"] < 1e-4
    capsys.readouterr()
    assert main(["inspect", str(src)]) == 0  # inspect reads it too


def test_what_onnxruntime_cannot_load_is_refused_in_one_line(tmp_path, capsys):
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    node = helper.make_node("Add", ["x", "missing"], ["y"])
    src = tmp_path / "bad.onnx"
    onnx.save(helper.make_model(helper.make_graph([node], "g", [x], [y])), str(src))
    capsys.readouterr()
    assert main(["optimize", str(src), "--out", str(tmp_path / "o.onnx")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: onnxruntime cannot load") and "missing" in err
    assert len(err.splitlines()) == 1 and not (tmp_path / "o.onnx").exists()


def test_an_output_that_differs_from_the_input_is_refused(tmp_path, monkeypatch, capsys):
    """A rewrite that changes the numbers (here: a pass that negates the output) is caught
    by the check against onnxruntime and nothing is written."""
    from onnx import TensorProto, helper

    from specport.passes import pipelines

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])
    src = tmp_path / "relu.onnx"
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(src))
    real = pipelines.optimize_model

    def wrong(model, *args, **kwargs):
        out, report = real(model, *args, **kwargs)
        node = next(iter(out.graph))
        node.op_type = "Neg"  # a broken rewrite
        return out, report

    monkeypatch.setattr(pipelines, "optimize_model", wrong)
    capsys.readouterr()
    assert main(["optimize", str(src), "--out", str(tmp_path / "o.onnx")]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    assert len(err) == 1 and "differs from onnxruntime running the input" in err[0]
    assert not (tmp_path / "o.onnx").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["relu.onnx"]


def _add_graph(path: Path, defs: str) -> Path:
    """y = x + w, with `w` defined twice in the ways hand-edited files carry: two Constant
    nodes (the later one appended at the end, as onnxruntime's tiny-model tool does), a Constant
    over an initializer, or a Constant over a graph input. onnxruntime keeps the last Constant."""
    from onnx import TensorProto, helper, numpy_helper

    def const(v: float):
        tensor = numpy_helper.from_array(np.full(4, v, np.float32), "w")
        return helper.make_node("Constant", [], ["w"], value=tensor)

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])
    add = helper.make_node("Add", ["x", "w"], ["y"])
    init = [numpy_helper.from_array(np.full(4, 5.0, np.float32), "w")]
    inputs = [x]
    nodes = {
        "two_constants": [const(1.0), add, const(2.0)],
        "constant_over_initializer": [const(3.0), add],
        "constant_over_input": [const(3.0), add],
    }[defs]
    if defs == "constant_over_input":
        inputs.append(helper.make_tensor_value_info("w", TensorProto.FLOAT, [4]))
        init = []
    elif defs == "two_constants":
        init = []
    graph = helper.make_graph(nodes, "torch-jit-export", inputs, [y], init)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])
    onnx.save(model, str(path))
    return path


@pytest.mark.parametrize(
    "defs", ["two_constants", "constant_over_initializer", "constant_over_input"]
)
def test_a_name_defined_twice_keeps_onnxruntimes_definition(tmp_path, capsys, defs):
    """onnxruntime loads these (the last Constant wins); the graph library refuses a value
    declared twice, which `optimize` used to report as a specport bug."""
    src = _add_graph(tmp_path / "dup.onnx", defs)
    info = _optimize(src, tmp_path / "o.onnx", capsys)
    assert any("defined more than once" in r for r in info["repairs"]), info["repairs"]
    assert info["parity"]["checked"] and info["parity"]["max_abs_error"] == 0
    feeds = {"x": np.zeros((1, 4), np.float32)}
    want = ort.InferenceSession(str(src)).run(None, feeds)[0]
    assert want[0, 0] in (2.0, 3.0)  # the last Constant, not the initializer or the first
    np.testing.assert_array_equal(
        ort.InferenceSession(str(tmp_path / "o.onnx")).run(None, feeds)[0], want
    )


@pytest.mark.parametrize("kind", ["sparse_constant", "sparse_initializer"])
def test_what_the_graph_library_cannot_read_is_refused_in_one_line(tmp_path, capsys, kind):
    """onnxruntime loads sparse constants; the graph library does not: one line with the cause."""
    from onnx import TensorProto, helper, numpy_helper

    values = numpy_helper.from_array(np.array([3.0], np.float32), "w")
    sparse = helper.make_sparse_tensor(values, numpy_helper.from_array(np.array([1]), "i"), [4])
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])
    nodes = [helper.make_node("Add", ["x", "w"], ["y"])]
    if kind == "sparse_constant":
        nodes.insert(0, helper.make_node("Constant", [], ["w"], sparse_value=sparse))
    graph = helper.make_graph(nodes, "g", [x], [y])
    if kind == "sparse_initializer":
        graph.sparse_initializer.append(sparse)
    src = tmp_path / "sparse.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)]), str(src))
    ort.InferenceSession(str(src))  # onnxruntime reads it
    capsys.readouterr()
    assert main(["optimize", str(src), "--out", str(tmp_path / "o.onnx")]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    assert len(err) == 1 and "bug in specport" not in err[0]
    assert "Sparse tensors" in err[0] or "sparse initializers" in err[0]
    assert not (tmp_path / "o.onnx").exists()
