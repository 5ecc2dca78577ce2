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
