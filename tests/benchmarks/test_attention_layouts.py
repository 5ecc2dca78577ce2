"""The decode-step benchmarks run on real graphs (no timing asserted): every attention layout
computes the same attention, and a step of a shared-layout export is split by op type.

The padded and grouped layouts are what a row-invariant decode would build; their outputs must
equal the exported layout's for the benchmark's timings to compare like with like."""

from __future__ import annotations

import argparse
import json

import pytest

from benchmarks.attention_layouts import measure
from benchmarks.decode_step_ops import measure as measure_step
from benchmarks.decode_step_ops import parse_shapes


@pytest.mark.parametrize(("rows", "context"), [(1, 16), (3, 40)])
def test_every_layout_computes_the_exported_attention(rows, context):
    r = measure(rows, context, heads=4, kv_heads=2, dim=16, threads=1, runs=2)
    assert r["padded_diff"] < 1e-5 and r["grouped_diff"] < 1e-5
    assert min(r["exported_ms"], r["padded_ms"], r["grouped_ms"]) > 0


def test_decode_step_ops_splits_a_step_of_a_shared_layout_export(tiny_zoo, tmp_path):
    artifact = tiny_zoo.shared("llama")
    r = measure_step(artifact, rows=2, context=5, threads=1, steps=2, tmp=str(tmp_path))
    assert r["step_ms"] > 0 and "GroupQueryAttention" in r["ops_ms"]
    cfg = json.loads((artifact / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_position = cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim * 4
    assert r["kv_bytes"] == 2 * 6 * per_position  # 2 rows, 5 cached positions + the new one


@pytest.mark.parametrize("bad", ["64by700", "1x0", "8x"])
def test_a_malformed_shape_is_a_usage_error(bad):
    with pytest.raises(argparse.ArgumentTypeError):
        parse_shapes(bad)
    assert parse_shapes("1x512,64x700") == [(1, 512), (64, 700)]


def test_a_grouped_copy_decodes_the_exported_tokens_and_verifies_them_the_same(tiny_zoo, tmp_path):
    """The whole-graph grouped layout (benchmarks/grouped_rows_graph.py) must compute the
    exported attention for its step timings to mean anything: greedy tokens equal the
    exported graph's, and a speculative run over it gives its own plain greedy tokens."""
    import shutil

    import onnx_ir as ir

    import specport
    from benchmarks.grouped_rows_graph import GroupQueryRowsPass
    from specport.artifact.manifest import read_manifest, write_manifest
    from specport.runtime.sampler import SamplingConfig
    from specport.runtime.speculative.loop import generate_speculative

    source = tiny_zoo.shared("llama")
    out = tmp_path / "grouped"
    shutil.copytree(source, out)
    model = ir.load(out / "model.onnx")
    result = GroupQueryRowsPass(max_tokens=8)(model)
    assert result.modified and result.report["layers"] >= 1
    ir.save(model, out / "model.onnx", external_data="model.onnx.data")
    write_manifest(out, read_manifest(source))
    exported, grouped = specport.load(source, threads=1), specport.load(out, threads=1)
    for ids in ([5, 6, 7, 5, 6, 7, 5], [9, 30, 31, 9, 30], list(range(40, 60))):
        plain = exported.generate(prompt_ids=ids, max_new_tokens=20, ignore_eos=True).tokens
        assert grouped.generate(prompt_ids=ids, max_new_tokens=20, ignore_eos=True).tokens == plain
        toks, _, _ = generate_speculative(
            grouped, ids, 20, "ngram", 4, None, SamplingConfig(), (), None, False
        )
        assert toks == plain, ids
