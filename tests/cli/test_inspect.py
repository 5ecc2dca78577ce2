"""`specport inspect` on an int8-KV artifact: the per-layer KV scales in one summary line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # exports and quantizes a tiny model (~10 s)


@pytest.fixture(scope="module")
def kv8(tmp_path_factory) -> Path:
    """The tiny shared-layout Llama with an int8 KV cache, layer 1 kept in float32."""
    from specport.passes.quant.apply import quantize_artifact
    from tests.export_cache import cached_export
    from tests.fixtures import TINY, make_llama
    from tests.passes.quant._tiny import write_corpus

    tmp = tmp_path_factory.mktemp("inspect_kv8")
    hf = make_llama(tmp / "hf", context_length=128, **TINY)  # type: ignore[arg-type]
    cached_export(hf, tmp / "fp32", skip_verify=True, progress=False, kv_layout="shared")
    calib = write_corpus(tmp / "calib.txt", docs=8)
    out = tmp / "kv8"
    quantize_artifact(
        tmp / "fp32",
        out,
        "none",
        kv_cache="int8",
        calib_files=[calib],
        kv_float_layers=[1],
    )
    return out


def test_kv_scales_are_one_line_and_in_full_in_json(cli, kv8):
    from specport.artifact.manifest import read_manifest

    kv = read_manifest(kv8).quant["kv_cache"]
    code, out, err = cli("inspect", kv8)
    assert code == 0, err
    line = next(t for t in out.splitlines() if t.startswith("quant "))
    assert "KV cache int8" in line and "layers int8 x1 [0], float32 x1 [1]," in line
    assert "per-layer scales: --json" in line
    assert f"over {len(kv['scales'])} tensors" in line
    assert "head_max" not in out and "scales': {" not in out  # no per-layer scale block
    assert len(line) < 200
    code, out, _ = cli("inspect", kv8, "--json")
    assert code == 0 and json.loads(out)["quant"]["kv_cache"]["scales"] == kv["scales"]


def test_quant_line_ranges_and_scale_span():
    from specport.commands.inspect import quant_line

    kv = {
        "dtype": "int8",
        "granularity": "per_head",
        "scales": {
            "present.0.key": [0.5, 0.25],
            "present.0.value": {"shape": [2, 4], "head_max": [2.0, 1.0], "head_min": [0.125, 1]},
        },
    }
    line = quant_line({"scheme": "none", "kv_cache": kv}, ["int8", "int8", "float32", "int8"])
    assert line == (
        "KV cache int8 (per_head), layers int8 x3 [0-1, 3], float32 x1 [2], "
        "scales 0.125..2 over 2 tensors (per-layer scales: --json)"
    )


def test_mtp_line_is_one_short_line():
    from specport.commands.inspect import mtp_line

    mtp = {
        "heads": 3,
        "heads_graph": {"file": "mtp_heads.onnx"},
        "training": {
            "source": "self-distillation (chat answers)",
            "steps": 2000,
            "draft_vocab": 8192,
            "heldout": {"acceptance_per_position": [0.5, 0.25, 0.14], "mean_accepted_length": 1.88},
        },
    }
    line = mtp_line(mtp)
    assert "\n" not in line and len(line) < 200
    assert "3 heads" in line and "2000 steps" in line and "1.88" in line and "8192" in line
    assert "--json" in line


def test_an_export_without_query_seqlens_says_it_verifies_row_by_row(cli, tiny_zoo, tmp_path):
    """Shared-layout graphs exported before attention got `query_seqlens` verify speculative
    rows one by one in the batching engine: inspect says so, and that re-exporting fixes it."""
    import shutil

    import onnx

    from specport.artifact import manifest as art

    fresh = tiny_zoo.shared("llama")
    code, out, err = cli("inspect", fresh)
    assert code == 0, err
    assert "batched_verify" in out and "yes (" in out and "re-export" not in out
    old = tmp_path / "old"
    shutil.copytree(fresh, old)
    model = onnx.load(str(old / "model.onnx"), load_external_data=False)
    attention = [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]
    assert attention and all(len(n.input) > 16 for n in attention)
    for node in attention:  # the graph as older exports wrote it: no input 16
        del node.input[16:]
    onnx.save(model, str(old / "model.onnx"))  # the external weights file is left as it is
    art.write_manifest(old, art.read_manifest(old, check_hashes=False))
    code, out, err = cli("inspect", old)
    assert code == 0, err
    line = next(t for t in out.splitlines() if t.startswith("batched_verify"))
    assert "one by one" in line and "re-export for batched verification" in line
    code, out, _ = cli("inspect", old, "--json")
    assert code == 0 and json.loads(out)["batched_verify"] is False


def test_text_output_reads_as_sentences_not_python_values(cli, kv8):
    """No `None` lines and no dict reprs: verify and source read as words."""
    code, out, err = cli("inspect", kv8)
    assert code == 0, err
    assert "None" not in out and "{'" not in out
    verify = next(t for t in out.splitlines() if t.startswith("verify "))
    assert "not checked at export (--skip-verify)" in verify  # the fixture skips it


def test_eval_line_with_its_reference():
    from specport.commands.inspect import eval_line, source_line, verify_line

    record = {
        "ppl": 5.5398,
        "of": "w4a16",
        "text": "valid.txt",
        "tokens": 2045,
        "docs": 64,
        "reference": {"ppl": 5.2647, "label": "float32"},
        "ppl_delta_rel": 5.5398 / 5.2647 - 1,
    }
    assert eval_line(record) == (
        "perplexity 5.5398 of w4a16 on valid.txt (2045 tokens, 64 docs); +5.23% vs float32 5.2647"
    )
    assert verify_line({"ok": True, "max_abs_logits": 1.9e-4}) == (
        "export matched PyTorch (max |logits diff| 0.00019)"
    )
    assert verify_line({"ok": False, "max_abs_logits": 0.5}).startswith("export did NOT")
    gguf = {"kind": "gguf", "path": "m.gguf", "gguf": {"tensor_types": {"F32": 3, "Q4_1": 7}}}
    assert source_line(gguf) == "gguf m.gguf (GGUF tensors: 3 F32, 7 Q4_1)"
