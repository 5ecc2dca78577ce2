"""Quantization at scale: statistics spilled to disk, one layer at a time, progress lines."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest

from specport.cli import main
from specport.passes.quant.calibration import SpilledStats
from specport.passes.quant.graph import find_weight_matmuls, layer_chunks


def test_spilled_stats_match_in_memory_gram(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    parts = [rng.normal(size=(n, 48)).astype(np.float32) for n in (7, 300, 65)]
    parts[1][3, 5] = 2e5  # beyond float16's range: rows are stored scaled by their absmax
    st = SpilledStats(tmp_path, keep_rows=100)
    for p in parts:
        st.append("x", p[None])  # [1, S, K] as onnxruntime returns it
    x = np.concatenate(parts).astype(np.float64)
    got = st["x"]
    assert got.rows == 372 and got.k == 48
    np.testing.assert_array_equal(got.lo, x.min(0))
    np.testing.assert_array_equal(got.hi, x.max(0))
    # float16 mantissa: relative error ~1e-3 per element, far below quantization noise
    np.testing.assert_allclose(got.hessian, x.T @ x / 372, rtol=2e-3, atol=2e-3)
    assert got.rows_sample().shape == (100, 48)
    sub = SpilledStats(tmp_path / "sub", keep_rows=10, max_rows=50)
    (tmp_path / "sub").mkdir()
    for p in parts:
        sub.append("x", p)
    assert sub["x"].rows == 50
    assert list(st) == ["x"] and len(st) == 1 and "y" not in st


@pytest.mark.slow
def test_fused_graph_groups_sites_by_decoder_layer(tiny_zoo) -> None:
    model = ir.load(tiny_zoo.artifact("llama", fuse=True) / "model.onnx")
    chunks = layer_chunks(find_weight_matmuls(model))
    # q k v o gate up down (q/k/v packed into one MatMul in the shared layout), twice; the head
    assert [len(c) for c in chunks] in ([7, 7, 1], [5, 5, 1])
    assert chunks[-1][0].lm_head


def test_cli_quantize_prints_a_line_per_layer(quant_src, calib_text, tmp_path, capsys) -> None:
    """Off a terminal (captured stderr) each layer gets a line with elapsed time and ETA."""
    rc = main(
        [
            "quantize",
            str(quant_src),
            "--out",
            str(tmp_path / "q"),
            "--scheme",
            "w4a8",
            "--calib",
            str(calib_text),
        ]
    )
    assert rc == 0
    err = capsys.readouterr().err
    pattern = (
        r"^quantizing weights \(default\): (\d+)/(\d+) \(\d+%\), [\d.hms]+ elapsed, "
        r"(ETA [\d.hms]+|done)$"
    )
    lines = re.findall(pattern, err, re.M)
    total = int(lines[-1][1])
    assert [int(d) for d, _, _ in lines] == list(range(1, total + 1))
    assert all(eta.startswith("ETA") for _, _, eta in lines[:-1]) and lines[-1][2] == "done"
    assert re.search(r"^calibrate: 24/24 \(100%\), [\d.hms]+ elapsed, done$", err, re.M)


@pytest.mark.parametrize("algo", ["rtn", "hqq", "gptq", "default"])
def test_row_chunks_quantize_exactly_like_the_whole_weight(algo: str) -> None:
    """Large weights are quantized in chunks of output rows (one shared GPTQ factorization):
    the codes, scales and zero points equal those of quantizing the weight at once."""
    from specport.passes.quant import weight_quant as W
    from specport.passes.quant.calibration import ActStats
    from specport.passes.quant.gptq import gptq_factor

    rng = np.random.default_rng(0)
    w = rng.normal(size=(64, 300)).astype(np.float32)
    x = rng.normal(size=(500, 64)).astype(np.float32)
    st = ActStats.empty(64)
    st.h, st.rows = (x.T @ x).astype(np.float64), 500
    whole = W.quantize_weight(w, algo, 4, 32, False, st, False)
    gptq = algo in ("gptq", "default")
    factor = gptq_factor(st.hessian, act_order=algo == "default") if gptq else None
    parts = [
        W.quantize_weight(
            np.ascontiguousarray(w[:, a : a + 64]), algo, 4, 32, False, st, False, factor
        )
        for a in range(0, 300, 64)
    ]
    joined = W.concat_rows(parts)
    np.testing.assert_array_equal(joined.q, whole.q)
    np.testing.assert_array_equal(joined.scale, whole.scale)
    np.testing.assert_array_equal(joined.zero, whole.zero)


@pytest.mark.slow
def test_export_quant_streams_to_the_same_weights_as_quantize(tmp_path: Path) -> None:
    """`export --quant w4a8` quantizes while the checkpoint streams (no float artifact): its
    blocks equal those of exporting in float and then running `specport quantize`."""
    import onnx

    import specport
    from specport.passes.quant.apply import quantize_artifact
    from tests.export_cache import cached_export
    from tests.fixtures import build_tiny_model

    src = build_tiny_model("llama", tmp_path / "src")
    m = cached_export(src, tmp_path / "direct", quant="w4a8", progress=False)
    assert m.quant["in_export"] and m.quant["scheme"] == "w4a8" and m.quant["embedding_bits"] == 8
    assert m.verify["skipped"] and "quantized" in m.verify["reason"]
    cached_export(src, tmp_path / "float", progress=False)
    quantize_artifact(tmp_path / "float", tmp_path / "two_step", "w4a8", None, "hqq")

    def blocks(d: Path) -> dict[str, np.ndarray]:
        proto = onnx.load(str(d / "model.onnx"))
        return {
            t.name: onnx.numpy_helper.to_array(t, base_dir=str(d))
            for t in proto.graph.initializer
            if ".q4." in t.name or ".q8." in t.name
        }

    a, b = blocks(tmp_path / "direct"), blocks(tmp_path / "two_step")
    assert a and a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    model = specport.load(tmp_path / "direct", provider="cpu")
    assert len(model.generate(prompt_ids=[1, 5, 6], max_new_tokens=4).tokens) == 4
