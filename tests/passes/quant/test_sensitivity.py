"""Loss per group of weights (passes/quant/sensitivity.py) and the Gram matrices kept beside
the spilled calibration rows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest

from specport.artifact.manifest import read_manifest
from specport.passes.quant import calibration as C
from specport.passes.quant.graph import find_weight_matmuls
from specport.passes.quant.sensitivity import HEAD, group_keys, loss_factors, measure_group_kl


@pytest.mark.parametrize("bands", [1, 2])
def test_groups_are_head_alone_then_shape_and_depth(quant_src: Path, bands: int) -> None:
    m = read_manifest(quant_src)
    sites = find_weight_matmuls(ir.load(quant_src / m.model_file))
    keys = group_keys(sites, bands)
    assert [keys[s.name] for s in sites if s.lm_head] == [HEAD]
    body = [keys[s.name] for s in sites if not s.lm_head]
    shapes = {(s.k, s.n) for s in sites if not s.lm_head}
    assert len(set(body)) == len(shapes) * bands  # the tiny model has 2 layers
    for s in sites:
        if not s.lm_head:
            assert keys[s.name].startswith(f"{s.k}x{s.n}/")


def test_group_kl_is_measured_and_turns_errors_into_loss(quant_src: Path, calib_text: Path):
    m = read_manifest(quant_src)
    model_path = quant_src / m.model_file
    sites = find_weight_matmuls(ir.load(model_path))
    seqs, feeds = C.calibration_sequences(m, quant_src, [calib_text], 8)
    keys, groups = measure_group_kl(model_path, sites, seqs, feeds, bands=1, max_rows=64)
    assert set(groups) == set(keys.values())
    assert all(g["kl"] > 0 and g["weights"] >= 1 for g in groups.values())
    errors = {s.name: 0.01 for s in sites}
    factors = loss_factors(keys, groups, errors)
    for s in sites:  # each tensor's share: the group's KL split by its relative errors
        g = keys[s.name]
        assert factors[s.name] * 0.01 * groups[g]["weights"] == pytest.approx(groups[g]["kl"])


def test_spilled_gram_is_built_once_and_read_back(tmp_path: Path) -> None:
    stats = C.SpilledStats(tmp_path)
    rng = np.random.default_rng(0)
    for _ in range(3):
        stats.append("x", rng.standard_normal((5, 7, 16)).astype(np.float32))
    first = stats["x"].h.copy()
    assert list(tmp_path.glob("*.gram.npy"))
    stats._cached = None  # a second pass asks again: read back, not rebuilt
    np.testing.assert_array_equal(stats["x"].h, first)


def test_tied_head_kl_is_the_saved_quantized_models(tiny_zoo, tmp_path: Path, calib_text: Path):
    """A tied head's group quantizes the table everywhere it is read: the KL measured with the
    override equals the KL of a copy saved with the fake-quantized table (head and gather)."""
    import onnxruntime as ort

    from specport.passes.quant.sensitivity import _fake_quantized, _log_probs
    from tests.passes.quant._tiny import with_tokenizer

    src = with_tokenizer(tiny_zoo.artifact("smollm3"), tmp_path / "src")
    m = read_manifest(src)
    model_path = src / m.model_file
    model = ir.load(model_path)
    (head,) = [s for s in find_weight_matmuls(model) if s.lm_head]
    assert head.transposed and any(u.op_type == "Gather" for u, _ in head.weight.uses())
    seqs, feeds = C.calibration_sequences(m, src, [calib_text], 4)
    _, groups = measure_group_kl(model_path, [head], seqs, feeds, max_rows=64)

    head.weight.const_value = ir.tensor(_fake_quantized(head, symmetric=False))
    saved = tmp_path / "quantized.onnx"
    ir.save(model, saved, external_data="quantized.onnx.data")
    rows = 0
    kl, n = 0.0, 0
    float_session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    quant_session = ort.InferenceSession(str(saved), providers=["CPUExecutionProvider"])
    for ids in seqs:
        if rows >= 64:
            break
        ids = ids[: 64 - rows]
        rows += len(ids)
        lp, lq = (
            _log_probs(s.run(["logits"], feeds(s, ids))[0][0])
            for s in (float_session, quant_session)
        )
        kl += float((np.exp(lp) * (lp - lq)).sum(dtype=np.float64))
        n += lp.shape[0]
    assert groups[HEAD]["kl"] == pytest.approx(kl / n, rel=1e-3)
