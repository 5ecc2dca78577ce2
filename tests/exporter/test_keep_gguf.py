"""--keep-gguf-quant: MatMulNBits blocks built from a GGUF file's own codes and scales."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip(
    "gguf", reason="the gguf extra is not installed (pip install 'specport[gguf]')"
)

from specport.passes.quant.blockquant import dequantize, pack_matmul_nbits
from specport.passes.quant.gguf_blocks import AFFINE_8BIT, APPROX, EXACT, block_quant
from tests.gguf_files import (
    K_QUANTS,
    _random_k_blocks,
    gpt2_vocab,
    random_model,
    tiny_config,
    write_gguf,
)

# Every matrix of one tiny Llama in a different type (the mix of a Q4_K_M-style file).
MIX = {
    "attn_q": "Q4_K",
    "attn_k": "Q4_K",
    "attn_v": "Q6_K",
    "attn_output": "Q5_0",
    "ffn_gate": "Q4_1",
    "ffn_up": "Q8_0",
    "ffn_down": "Q5_K",
    "token_embd": "Q4_0",
    "output": "Q6_K",
}


@pytest.mark.parametrize("qtype", sorted(EXACT | APPROX | AFFINE_8BIT))
def test_blocks_dequantize_like_gguf(qtype: str) -> None:
    """The MatMulNBits form computes gguf's own dequantization: bit-exact or ~1 ulp."""
    from gguf import GGMLQuantizationType as Q

    rng = np.random.default_rng(0)
    n, k = 24, 512
    if qtype in K_QUANTS:
        raw = _random_k_blocks(n, k, qtype, rng)
    else:
        raw = gguf.quants.quantize(
            (rng.standard_normal((n, k)) * 0.05).astype(np.float32), Q[qtype]
        )
    want = gguf.quants.dequantize(raw, Q[qtype])  # [N, K]
    bq = block_quant(raw, qtype, n, k)
    got = dequantize(bq).T
    if qtype in EXACT:
        assert np.array_equal(got, want)
    else:
        assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max()
    assert bq.bits == (4 if qtype in ("Q4_0", "Q4_1", "Q4_K") else 8)
    packed = pack_matmul_nbits(bq)  # what the graph stores
    assert packed["B"].shape[0] == n


def test_constant_block_is_kept_exactly() -> None:
    from gguf import GGMLQuantizationType as Q

    raw = gguf.quants.quantize(np.full((2, 64), 0.25, np.float32), Q.Q4_1)  # scale 0, min 0.25
    bq = block_quant(raw, "Q4_1", 2, 64)
    assert np.array_equal(dequantize(bq).T, gguf.quants.dequantize(raw, Q.Q4_1))


@pytest.mark.slow
def test_cli_keep_gguf_quant_matches_the_dequantized_export(tmp_path: Path) -> None:
    import specport
    from specport.cli import main

    vocab = gpt2_vocab()
    model = random_model(tiny_config("llama", len(vocab["tokens"])))
    path = write_gguf(model, vocab, tmp_path / "mix.gguf", qtype=MIX)
    concat = ["--kv-layout", "concat"]  # the graph layout these counts were written for
    assert main(["export", str(path), "--out", str(tmp_path / "float"), *concat]) == 0
    kept_args = ["--out", str(tmp_path / "kept"), "--keep-gguf-quant", *concat]
    assert main(["export", str(path), *kept_args]) == 0

    manifest = json.loads((tmp_path / "kept" / "specport.json").read_text())
    quant = manifest["quant"]
    assert quant["scheme"] == "gguf"
    assert quant["exact_types"] == ["Q5_0", "Q6_K", "Q8_0"]
    assert quant["affine_types"] == ["Q4_1", "Q4_K"]
    assert 0 < quant["max_abs_weight_diff"] < 1e-6
    layers = manifest["passes"][-1]["layers"]
    assert {v["gguf_type"] for v in layers.values() if v["bits"] == 32} == {"Q5_K"}  # ffn_down
    assert {v["bits"] for v in layers.values()} == {4, 8, 32}
    import onnx

    graph = onnx.load(str(tmp_path / "kept" / "model.onnx"), load_external_data=False).graph
    weights = {i.name for i in graph.initializer}
    # a float zero point (Q4_1, Q4_K) adds one small block-offsets MatMul beside its MatMulNBits
    float_weights = {w for w in weights if not w.endswith("block_offsets")}
    float_matmuls = [
        n for n in graph.node if n.op_type == "MatMul" and set(n.input) & float_weights
    ]
    assert len(float_matmuls) == 2  # the Q5_K ffn_down of each layer

    ids = [1, 40, 41, 200, 7, 99, 123, 64]
    floats = specport.load(tmp_path / "float")
    kept = specport.load(tmp_path / "kept")
    want = floats.generate(prompt_ids=ids, max_new_tokens=24, ignore_eos=True).tokens
    assert kept.generate(prompt_ids=ids, max_new_tokens=24, ignore_eos=True).tokens == want


def test_keep_gguf_quant_needs_a_gguf_source(tmp_path: Path) -> None:
    from specport.cli import main

    assert main(["export", str(tmp_path), "--out", str(tmp_path / "o"), "--keep-gguf-quant"]) == 2
