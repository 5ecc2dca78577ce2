"""SmoothQuant's x / s folded into the weight that makes x costs nothing at run time and must
change nothing in real arithmetic: the down projection's into the up projection's columns
(SwiGLU), the output projection's into the value columns of the attention's packed QKV (tied
over the query heads of each KV head). Checked on a float shared-layout export: fold a random
s, multiply x back by s in the graph, and the logits must be the export's."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest

from specport.artifact.manifest import read_manifest
from specport.passes.quant.graph import find_weight_matmuls
from specport.passes.quant.smoothquant import search_smoothquant
from specport.passes.quant.w8a8 import _fold_into_columns, _linear_producer


def _logits(model: ir.Model, path, feeds: dict) -> np.ndarray:
    ir.save(model, path, external_data=f"{path.name}.data")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(["logits"], feeds)[0]


def _feeds(model_path) -> dict:
    session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    steps = 6
    feeds = {
        "input_ids": np.arange(3, 3 + steps, dtype=np.int64)[None],
        "seqlens_k": np.array([steps - 1], np.int32),
        "total_sequence_length": np.array(steps, np.int32),
    }
    for i in session.get_inputs():
        if i.name.startswith("past"):
            shape = [1 if not isinstance(d, int) else d for d in i.shape]
            shape[2] = 16
            feeds[i.name] = np.zeros(shape, np.float32)
        elif i.name in ("logits_index", "position_ids"):
            feeds[i.name] = np.arange(steps, dtype=np.int64)[None]
    return feeds


# what folds on each tiny shared export: the gated MLP's down projection (Mul) and the
# attention's output projection (GroupQueryAttention); Phi-3's export slices q/k/v out of the
# packed projection and reshapes the attention output before the output projection, so only
# its MLP folds and the output projection keeps its run-time Mul
FOLDS = {
    "llama": {"GroupQueryAttention", "Mul"},
    "qwen2": {"GroupQueryAttention", "Mul"},  # a bias on the QKV projection
    "gemma2": {"GroupQueryAttention", "Mul"},  # GeGLU, soft-capped attention
    "phi3": {"Mul"},
}


@pytest.mark.parametrize(
    "model_type",
    [m if m == "llama" else pytest.param(m, marks=pytest.mark.slow) for m in FOLDS],
)
def test_folded_smoothing_is_exact_in_real_arithmetic(tiny_zoo, tmp_path, model_type):
    artifact = tiny_zoo.shared(model_type)
    feeds = _feeds(artifact / "model.onnx")
    reference = _logits(ir.load(artifact / "model.onnx"), tmp_path / "ref.onnx", feeds)
    model = ir.load(artifact / "model.onnx")
    groups: dict[str, list] = {}
    for site in find_weight_matmuls(model):
        if not site.lm_head:
            groups.setdefault(site.x.name, []).append(site)
    rng = np.random.default_rng(0)
    kinds: Counter[str] = Counter()
    for sites in groups.values():
        producer = _linear_producer(sites[0].x, sites)
        if producer is None:
            continue
        kinds[sites[0].x.producer().op_type] += 1
        s = rng.uniform(0.25, 4.0, sites[0].k).astype(np.float32)
        if producer.tie is not None:
            s = producer.tie(s)
        weight = producer.weight.const_value.numpy()
        producer.weight.const_value = ir.tensor(_fold_into_columns(producer, weight, s))
        x = sites[0].x
        undo = ir.node("Mul", [x, ir.Value(name=f"{x.name}.s", const_value=ir.tensor(s))])
        model.graph.initializers.add(undo.inputs[1])
        for site in sites:
            site.node.replace_input_with(0, undo.outputs[0])
        model.graph.insert_before(sites[0].node, undo)
    layers = read_manifest(artifact).config["num_layers"]
    assert kinds == dict.fromkeys(FOLDS[model_type], layers), kinds
    folded = _logits(model, tmp_path / "folded.onnx", feeds)
    np.testing.assert_allclose(folded, reference, rtol=1e-4, atol=1e-4)


def test_tied_smoothing_is_equal_within_each_tie():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((64, 8)).astype(np.float32)
    weights = [rng.standard_normal((8, 5)).astype(np.float32)]

    def tie(v: np.ndarray) -> np.ndarray:  # channels 0-3 share a scale, 4-7 another
        return np.repeat(v.reshape(2, 4).max(axis=1), 4)

    alpha, s, _ = search_smoothquant(
        x * [1, 1, 9, 1, 1, 1, 1, 1], weights, np.abs(x).max(0) * 9, tie=tie
    )
    assert alpha is not None and s is not None
    assert np.all(s[:4] == s[0]) and np.all(s[4:] == s[4])


def _cached(artifact, ids: list[int]) -> list[np.ndarray]:
    """The keys and values a prefill of `ids` caches, per layer (manifest order)."""
    import specport
    from specport.runtime.kv.seq_cache import open_cache

    model = specport.load(artifact, threads=1)
    cache = open_cache(model.session, model.manifest, 32)
    cache.step(ids)
    return [b[0, :, : len(ids)].copy() for b in cache.bound.buffers]


def test_keep_kv_values_leaves_the_cache_holding_the_source_values(tiny_zoo, calib_text, tmp_path):
    """The output projection's smoothing folded into the value columns divides what the KV
    cache holds by it; `keep_kv_values` leaves those values as the float model's (up to 8-bit
    rounding), so a W8A8 draft can draft in its float target's cache, and the manifest says
    which the cache holds. Without calibration text there is no smoothing at all."""
    from specport import quantize
    from specport.core.errors import QuantizationError
    from tests.passes.quant._tiny import with_tokenizer

    src = with_tokenizer(tiny_zoo.shared("llama"), tmp_path / "src")
    ids = list(range(3, 15))
    reference = _cached(src, ids)
    values = slice(1, None, 2)  # keys and values alternate
    error, said = {}, {}
    for keep in (False, True):
        out = tmp_path / f"w8-{keep}"
        manifest = quantize(src, out, scheme="w8a8", calib_files=[calib_text], keep_kv_values=keep)
        said[keep] = manifest.quant["kv_values"]
        report = next(p for p in manifest.passes if p["name"] == "quantize_w8a8")
        assert (report["smoothing_into_values"] == 0) == keep
        assert (report["unsmoothed_for_kv"] > 0) == keep
        got = _cached(out, ids)
        error[keep] = max(
            float(np.abs(a - r).max() / np.abs(r).max())
            for a, r in zip(got[values], reference[values])
        )
    assert said == {False: "smoothed", True: "source"}
    assert error[True] < 0.05 and error[False] > 4 * error[True], error
    # without calibration text nothing is smoothed: round-to-nearest, the source's values
    bare = quantize(src, tmp_path / "w8-rtn", scheme="w8a8")
    assert bare.quant["kv_values"] == "source"
    got = _cached(tmp_path / "w8-rtn", ids)
    assert (
        max(
            float(np.abs(a - r).max() / np.abs(r).max())
            for a, r in zip(got[values], reference[values])
        )
        < 0.05
    )
    with pytest.raises(QuantizationError, match="w8a8 option"):
        quantize(src, tmp_path / "w4", scheme="w4a8", keep_kv_values=True)
