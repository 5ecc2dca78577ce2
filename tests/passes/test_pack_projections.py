"""pack_projections: sibling MatMuls of one input -> one MatMul + Split, numbers unchanged."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from specport.passes.base import op_counts
from specport.passes.pack_projections import PackProjectionsPass
from specport.passes.pipelines import optimize_model
from tests.passes.graph_models import cpu_session, kv_dims

T = 24  # shared buffer length


def _report(report: dict, name: str) -> dict:
    return next(p for p in report["passes"] if p["name"] == name)


def _shared_feeds(dims: tuple[int, ...], ids: np.ndarray, past: int) -> dict[str, np.ndarray]:
    """Feeds for one shared-layout step of batch 1: `ids` [1, S] after `past` cached tokens."""
    n_layers, hkv, hd = dims
    s = ids.shape[1]
    rng = np.random.default_rng(1)
    feeds = {
        "input_ids": ids.astype(np.int64),
        "position_ids": np.arange(past, past + s, dtype=np.int64)[None],
        "seqlens_k": np.array([past + s - 1], np.int32),
        "total_sequence_length": np.array(past + s, np.int32),
    }
    for i in range(n_layers):
        for kv in ("key", "value"):
            feeds[f"past_key_values.{i}.{kv}"] = rng.standard_normal((1, hkv, T, hd), np.float32)
    return feeds


def test_shared_pipeline_packs_gate_up_with_identical_logits(tiny_export, tmp_path):
    model, path = tiny_export("llama")
    dims = kv_dims(model)
    opts = dict(kv_layout="shared", max_length=T, rotary_length=T, pack_qkv=True)  # as export
    packed, report = optimize_model(path, "cpu", **opts)
    plain, _ = optimize_model(path, "cpu", **opts, pack_projections=False)
    rep = _report(report, "pack_projections")
    n_layers = dims[0]
    # q/k/v already went into GQA's packed input (shared_kv); gate/up remain, one pair a layer
    assert rep["changed"] == n_layers and rep["packed_matmuls"] == 2 * n_layers
    assert rep["group_widths"] == {"128+128": n_layers}
    assert rep["matched"] >= 4 * n_layers + 1  # qkv, o, gate, up per layer + LM head
    assert op_counts(packed)["MatMul"] == op_counts(plain)["MatMul"] - n_layers
    assert op_counts(packed)["Split"] == n_layers
    names = [v.name for v in packed.graph.inputs]
    assert names == [v.name for v in plain.graph.inputs]
    a = cpu_session(packed, tmp_path / "packed")
    b = cpu_session(plain, tmp_path / "plain")
    prefill = np.array([[5, 17, 33, 2, 9, 41]])
    wanted = {i.name for i in a.get_inputs()}
    for ids, past in ((prefill, 0), (np.array([[7]]), 6)):
        feeds = {k: v for k, v in _shared_feeds(dims, ids, past).items() if k in wanted}
        got, want = a.run(None, feeds), b.run(None, feeds)
        for x, y in zip(got, want):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)


def test_qkv_split_when_not_packed_into_gqa_and_concat_left_alone(tiny_export):
    _, path = tiny_export("llama")
    _, report = optimize_model(path, "cpu", kv_layout="shared", max_length=T, pack_projections=True)
    rep = _report(report, "pack_projections")  # q [64] + k, v [2 heads x 16] and gate/up
    assert rep["group_widths"] == {"64+32+32": 2, "128+128": 2} and rep["changed"] == 4
    _, report = optimize_model(path, "cpu")
    assert all(p["name"] != "pack_projections" for p in report["passes"])


def _biased_graph() -> tuple[ir.Model, dict[str, np.ndarray]]:
    """x [2, 3, 8] -> three projections (two with bias Adds) + one on another input."""
    rng = np.random.default_rng(0)
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2, 3, 8]))
    y = ir.Value(name="y", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2, 3, 8]))
    graph = ir.Graph([x, y], [], nodes=[], opset_imports={"": 21}, name="g")
    arrays: dict[str, np.ndarray] = {}

    def init(name: str, shape: tuple[int, ...]) -> ir.Value:
        arr = rng.standard_normal(shape).astype(np.float32)
        arrays[name] = arr
        v = ir.Value(name=name, const_value=ir.tensor(arr, name=name), shape=ir.Shape(shape))
        v.type = ir.TensorType(ir.DataType.FLOAT)
        graph.register_initializer(v)
        return v

    outs = []
    for i, (n, biased) in enumerate(((4, True), (6, False), (5, True))):
        mm = ir.node("MatMul", [x, init(f"w{i}", (8, n))], name=f"mm{i}")
        graph.append(mm)
        out = mm.outputs[0]
        if biased:
            add = ir.node("Add", [out, init(f"b{i}", (n,))], name=f"add{i}")
            graph.append(add)
            out = add.outputs[0]
        relu = ir.node("Relu", [out], name=f"relu{i}")
        graph.append(relu)
        relu.outputs[0].name = f"out{i}"
        outs.append(relu.outputs[0])
    lone = ir.node("MatMul", [y, init("w_lone", (8, 3))], name="lone")
    graph.append(lone)
    lone.outputs[0].name = "out_lone"
    graph.outputs.extend([*outs, lone.outputs[0]])
    for v in graph.outputs:
        v.type = ir.TensorType(ir.DataType.FLOAT)
    feeds = {
        "x": rng.standard_normal((2, 3, 8)).astype(np.float32),
        "y": rng.standard_normal((2, 3, 8)).astype(np.float32),
    }
    return ir.Model(graph, ir_version=10), feeds


def test_biases_are_packed_and_outputs_unchanged(tmp_path):
    model, feeds = _biased_graph()
    want = cpu_session(model, tmp_path / "before").run(None, feeds)
    result = PackProjectionsPass()(model)
    rep = result.report
    assert result.modified
    assert rep["matched"] == 4 and rep["changed"] == 1 and rep["packed_matmuls"] == 3
    assert rep["biased_groups"] == 1 and rep["group_widths"] == {"4+6+5": 1}
    assert rep["ops_after"] == {"Add": 1, "MatMul": 2, "Relu": 3, "Split": 1}
    got = cpu_session(model, tmp_path / "after").run(None, feeds)
    for x, y in zip(got, want):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)
    again = PackProjectionsPass()(model)  # idempotent: nothing left to pack
    assert not again.modified and again.report["changed"] == 0


def test_shared_weight_is_not_packed():
    model, _ = _biased_graph()
    graph = model.graph
    w0 = graph.initializers["w0"]
    extra = ir.node("MatMul", [graph.inputs[1], w0], name="reuse")  # w0 read twice
    graph.append(extra)
    extra.outputs[0].name = "out_reuse"
    extra.outputs[0].type = ir.TensorType(ir.DataType.FLOAT)
    graph.outputs.append(extra.outputs[0])
    rep = PackProjectionsPass()(model).report
    assert rep["changed"] == 1 and rep["packed_matmuls"] == 2  # w1 + w2 only


@pytest.mark.slow
def test_packed_greedy_tokens_identical(tmp_path, monkeypatch):
    """Artifacts exported with and without the pass generate the same greedy tokens."""
    import specport
    from specport.exporter.export import export_model
    from specport.passes import pipelines
    from tests.fixtures import TINY, make_llama

    hf = make_llama(tmp_path / "hf", context_length=128, **TINY)
    export_model(hf, tmp_path / "packed", kv_layout="shared", progress=False)
    monkeypatch.setattr(pipelines, "PackProjectionsPass", lambda: PackProjectionsPass(10**9))
    export_model(hf, tmp_path / "plain", kv_layout="shared", progress=False)
    prompts = [[1, 74, 75, 76, 90], [1, 100], [1, 5, 6, 7, 8, 9, 10, 11, 12]]
    tokens = {}
    for name in ("packed", "plain"):
        art = specport.load(tmp_path / name, provider="cpu", threads=1)
        passes = {p["name"]: p for p in art.manifest.passes}
        assert passes["pack_projections"]["changed"] == (2 if name == "packed" else 0)
        out = art.generate_batch(prompt_ids=prompts, max_new_tokens=12, ignore_eos=True)
        tokens[name] = [r.tokens for r in out]
        assert art.generate(prompt_ids=prompts[0], max_new_tokens=2).metrics["io_binding"]
    assert tokens["packed"] == tokens["plain"]
