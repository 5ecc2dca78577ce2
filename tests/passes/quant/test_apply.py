"""quantize_artifact end to end on the tiny artifact: manifest, files, errors, baselines, CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specport.artifact.manifest import read_manifest
from specport.cli import main
from specport.core.errors import QuantizationError
from specport.passes.quant.apply import quantize_artifact
from specport.runtime.eval import perplexity


def test_w4_artifact_manifest_and_ppl(quant_src, calib_text, eval_text, tmp_path):
    out = tmp_path / "w4"
    m = quantize_artifact(quant_src, out, "w4a16", 32, "default", [calib_text])
    m2 = read_manifest(out)  # hashes verified
    assert m2.quant["scheme"] == "w4a16" and m2.quant["algorithm"] == "default"
    assert m2.quant["calibration"]["sha256"] and len(m2.quant["calibration"]["sha256"]) == 64
    # 32: the LM head stays float by default; 8: the embedding table (GatherBlockQuantized)
    assert set(m2.quant["layers"].values()) == {4, 8, 32} and m2.quant["embedding_bits"] == 8
    names = [p["name"] for p in m2.passes]
    assert names[-2:] == ["quantize_weights_nbits", "quantize_embedding"]
    assert len(m2.passes) == len(read_manifest(quant_src).passes) + 2
    assert (out / "tokenizer.json").is_file() and "tokenizer.json" in m2.files
    quantized = [b for b in m.quant["layers"].values() if b == 4]
    # q/k/v and gate/up are packed into one MatMulNBits each: 4 nodes per layer
    packed = m2.passes[-2]["packed_groups"]
    assert packed == 4  # 2 layers x (qkv, gate/up)
    assert m2.quant["ort_cpu"]["kernels"]["com.microsoft.MatMulNBits"] == len(quantized) - 6
    ppl = perplexity(out, eval_text)["ppl"]
    base = perplexity(quant_src, eval_text)["ppl"]
    assert abs(ppl / base - 1) < 0.25


def test_mixed_precision_auto_records_plan(quant_src, calib_text, tmp_path):
    m = quantize_artifact(
        quant_src, tmp_path / "mx", "w4a16", 32, "rtn", [calib_text], mixed_precision="auto"
    )
    plan = next(p for p in m.passes if p["name"] == "plan_mixed_precision")
    assert plan["layers_scored"] and all("outlier_ratio" in r for r in plan["layers_scored"])
    assert {r["name"] for r in plan["layers_scored"]} <= set(m.quant["layers"])
    for name in plan["promoted"]:
        assert m.quant["layers"][name] == 8


@pytest.mark.parametrize("algo", ["ort-default", "ort-hqq"])
def test_ort_baselines(quant_src, tmp_path, algo):
    m = quantize_artifact(quant_src, tmp_path / algo, "w4a16", 32, algo, [])
    assert m.quant["ort_cpu"]["kernels"].get("com.microsoft.MatMulNBits", 0) >= 1


def test_errors(quant_src, tmp_path):
    with pytest.raises(QuantizationError, match="needs calibration"):
        quantize_artifact(quant_src, tmp_path / "a", "w4a16", 32, "gptq", [])
    with pytest.raises(QuantizationError, match="needs calibration"):
        quantize_artifact(quant_src, tmp_path / "b", "w8a8", 32, "default", [], form="qdq")
    with pytest.raises(QuantizationError, match="group size 48"):
        quantize_artifact(quant_src, tmp_path / "c", "w4a16", 48, "rtn", [])
    with pytest.raises(QuantizationError, match="calibration file not found"):
        quantize_artifact(quant_src, tmp_path / "d", "w4a16", 32, "gptq", [tmp_path / "nope.txt"])
    assert not (tmp_path / "a").exists()


def test_cli_quantize_and_eval(quant_src, calib_text, eval_text, tmp_path, capsys):
    out = tmp_path / "cli"
    rc = main(
        [
            "quantize",
            str(quant_src),
            "--out",
            str(out),
            "--scheme",
            "w8a8",
            "--calib",
            str(calib_text),
            "--json",
        ]
    )
    assert rc == 0
    info = json.loads(capsys.readouterr().out)
    assert info["scheme"] == "w8a8" and info["group_size"] == 64  # row-invariant blocks
    # default form: 8-bit MatMulNBits with int8 activations (accuracy_level 4), head included
    assert info["ort_cpu"]["kernels"]["com.microsoft.MatMulNBits"] == info["layers"] - 6  # packed
    assert read_manifest(out).quant["form"] == "matmulnbits"
    assert read_manifest(out).quant["accuracy_level"] == 4
    assert main(["eval", "ppl", str(out), "--text", str(eval_text), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ppl"] > 1
    assert (
        main(["eval", "compare", str(quant_src), str(out), "--text", str(eval_text), "--json"]) == 0
    )
    cmp = json.loads(capsys.readouterr().out)
    assert 0.5 < cmp["top1_agreement"] <= 1 and cmp["kl"] >= 0
    assert (
        main(
            [
                "quantize",
                str(quant_src),
                "--out",
                str(tmp_path / "x"),
                "--scheme",
                "w4a16",
                "--algo",
                "clip",
            ]
        )
        == 2  # a usage error: the options alone cannot work
    )
    assert "needs calibration" in capsys.readouterr().err


def test_calib_file_missing_message(tmp_path):
    from specport.passes.quant.calibration import read_documents

    with pytest.raises(QuantizationError, match="--calib"):
        read_documents([Path(tmp_path / "missing.txt")])


def test_unknown_layout_refused(quant_src, tmp_path):
    import shutil

    from specport.artifact.files import write_artifact_manifest

    art = tmp_path / "odd"
    shutil.copytree(quant_src, art)
    m = read_manifest(art)
    m.kv.layout = "paged"
    write_artifact_manifest(art, m)
    with pytest.raises(QuantizationError, match="concat"):
        quantize_artifact(art, tmp_path / "o", "w4a16", 32, "rtn", [])


def test_form_checked_per_scheme(quant_src, tmp_path):
    with pytest.raises(QuantizationError, match="form"):
        quantize_artifact(quant_src, tmp_path / "o", "w4a16", 32, "rtn", [], form="dynamic")


def test_symmetric_weights_have_no_zero_points(quant_src, eval_text, tmp_path, capsys):
    """`--symmetric`: MatMulNBits without zero points (onnxruntime's faster int8-activation
    path), recorded in the recipe; perplexity stays near the float model's. Without --algo
    (no calibration text) the calibration-free scale search runs; onnxruntime's own HQQ, which
    fits zero points, is refused with a usage error before any work."""
    import onnx

    out = tmp_path / "sym"
    rc = main(["quantize", str(quant_src), "--out", str(out), "--scheme", "w4a8", "--algo", "rtn",
               "--symmetric", "-q"])  # fmt: skip
    assert rc == 0
    m = read_manifest(out)
    assert m.quant["symmetric"] is True
    graph = onnx.load(str(out / m.model_file), load_external_data=False).graph
    nbits = [n for n in graph.node if n.op_type == "MatMulNBits"]
    assert nbits and all(len(n.input) == 3 for n in nbits)
    ppl, base = perplexity(out, eval_text)["ppl"], perplexity(quant_src, eval_text)["ppl"]
    assert abs(ppl / base - 1) < 0.25
    searched = tmp_path / "searched"
    rc = main(["quantize", str(quant_src), "--out", str(searched), "--scheme", "w4a8",
               "--symmetric", "-q"])  # fmt: skip
    assert rc == 0 and read_manifest(searched).quant["symmetric"] is True
    assert abs(perplexity(searched, eval_text)["ppl"] / base - 1) < 0.25
    rc = main(["quantize", str(quant_src), "--out", str(tmp_path / "h"), "--scheme", "w4a8",
              "--algo", "ort-hqq", "--symmetric"])  # fmt: skip
    assert rc == 2 and "--symmetric needs" in capsys.readouterr().err
    assert not (tmp_path / "h").exists()
