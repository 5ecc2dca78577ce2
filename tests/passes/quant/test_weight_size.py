"""Bits per weight as stored (core/weight_size.py), checked against a count by hand of what
a tiny quantized artifact must hold, and shown by inspect, eval ppl and the model card."""

from __future__ import annotations

import json
from math import ceil

import pytest

from specport.artifact.manifest import read_manifest
from specport.build import quantize
from specport.cli import main
from specport.core.weight_size import artifact_weight_size


def _matmuls(c: dict) -> list[tuple[int, int]]:
    """(K, N) of every decoder MatMul of a Llama config."""
    h, f, d = c["hidden_size"], 128, c["head_dim"]  # tests/fixtures.py: intermediate 128
    q, kv = c["num_heads"] * d, c["num_kv_heads"] * d
    per_layer = [(h, q), (h, kv), (h, kv), (q, h), (h, f), (h, f), (f, h)]
    return per_layer * c["num_layers"]


def _nbits(k: int, n: int, bits: int, g: int) -> int:
    """MatMulNBits bytes by hand: codes, one float32 scale per block, packed uint8 zero points."""
    blocks = ceil(k / g)
    return n * blocks * g * bits // 8 + n * blocks * 4 + n * ceil(blocks * bits / 8)


def _matrices(c: dict) -> int:
    """Parameters in weight matrices: the MatMuls, the table and the (untied) head."""
    return sum(k * n for k, n in _matmuls(c)) + 2 * c["vocab_size"] * c["hidden_size"]


def _vectors(src) -> int:
    """The float vectors the export kept (norm weights; the unfused graph folds the all-ones
    ones away, so they are read from the float source rather than assumed)."""
    m = read_manifest(src)
    return artifact_weight_size(src, m).params - _matrices(m.config)


def test_float_artifact_is_32_bits(quant_src):
    m = read_manifest(quant_src)
    size = artifact_weight_size(quant_src, m)
    c = m.config
    assert 0 < _vectors(quant_src) <= (2 * c["num_layers"] + 1) * c["hidden_size"] + c["head_dim"]
    assert size.bits_per_weight == 32.0
    assert size.weight_bytes == 4 * size.params
    assert size.excluded_bytes > 0  # integer shape constants are not weights


@pytest.mark.parametrize("head_bits", [4, 8])
def test_quantized_size_equals_hand_count(quant_src, tmp_path, head_bits):
    out = tmp_path / "q"
    m = quantize(
        quant_src,
        out,
        scheme="w4a16",
        algo="rtn",
        group_size=32,
        lm_head_bits=head_bits,
        embedding_bits=8,
    )
    c = m.config
    h, v = c["hidden_size"], c["vocab_size"]
    vectors = _vectors(quant_src)
    params = _matrices(c) + vectors
    body = sum(_nbits(k, n, 4, 32) for k, n in _matmuls(c))
    head = _nbits(h, v, head_bits, 32)
    table = v * h + v * (h // 32) * 4 + v * (h // 32)  # GatherBlockQuantized 8-bit
    want = body + head + table + 4 * vectors
    size = m.quant["size"]
    assert size["params"] == params
    assert size["weight_bytes"] == want
    assert size["bits_per_weight"] == pytest.approx(8 * want / params, abs=1e-4)
    assert artifact_weight_size(out, read_manifest(out)).weight_bytes == want


def test_size_shown_by_inspect_eval_and_card(quant_src, eval_text, tmp_path, capsys):
    out = tmp_path / "q"
    quantize(quant_src, out, scheme="w4a16", algo="rtn", lm_head_bits=8)
    bpw = read_manifest(out).quant["size"]["bits_per_weight"]
    assert main(["inspect", str(out)]) == 0
    assert f"{bpw:.2f} bits per weight" in capsys.readouterr().out
    assert main(["eval", "ppl", str(out), "--text", str(eval_text), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["bits_per_weight"] == bpw
    assert f"Size: {bpw:.2f} bits per weight" in (out / "README.md").read_text()
