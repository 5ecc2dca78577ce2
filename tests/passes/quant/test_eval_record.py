"""`specport eval ... --record` (artifact/eval_record.py) on a tiny artifact: the manifest and the
model card carry the measured perplexity (and a quantized artifact's float32 reference and
delta), every hash still verifies, and nothing is written without --record."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from specport.artifact.manifest import MANIFEST_NAME, read_manifest
from specport.cli import main
from specport.passes.quant.apply import quantize_artifact
from tests.passes.quant._tiny import write_corpus


def _snapshot(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}


@pytest.fixture()
def src(quant_src: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(quant_src, tmp_path / "src"))


def _ppl(args: list[str], capsys) -> dict:
    assert main([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_eval_without_record_changes_nothing(src, eval_text, capsys):
    before = _snapshot(src)
    _ppl(["eval", "ppl", str(src), "--text", str(eval_text)], capsys)
    assert _snapshot(src) == before


@pytest.mark.slow
def test_record_fp32_then_quantize_carries_reference(src, eval_text, tmp_path, capsys):
    r = _ppl(["eval", "ppl", str(src), "--text", str(eval_text), "--record"], capsys)
    m = read_manifest(src)  # hashes (the regenerated card's included) still verify
    ev = m.extra["eval"]
    assert ev["ppl"] == pytest.approx(r["ppl"]) and ev["tokens"] == r["tokens"]
    assert ev["text"] == "eval.txt" and len(ev["text_sha256"]) == 64 and "reference" not in ev
    card = (src / "README.md").read_text()
    assert f"Perplexity {r['ppl']:.4f} on `eval.txt`" in card
    assert m.files["README.md"]  # the card stays listed with its new hash

    q = tmp_path / "q"
    quantize_artifact(src, q, scheme="w4a16", algo="rtn")
    qm = read_manifest(q)
    assert "eval" not in qm.extra  # the source's number is not this artifact's
    assert qm.extra["source_eval"]["ppl"] == pytest.approx(r["ppl"])
    assert "not measured" in (q / "README.md").read_text()

    rq = _ppl(["eval", "ppl", str(q), "--text", str(eval_text), "--record"], capsys)
    qev = read_manifest(q).extra["eval"]
    assert qev["reference"] == {
        "ppl": pytest.approx(r["ppl"]),
        "label": "float32",
        "via": "quantize",
    }
    assert qev["ppl_delta"] == pytest.approx(rq["ppl"] - r["ppl"])
    want = (
        f"Perplexity {rq['ppl']:.4f} on `eval.txt` (float32 source {r['ppl']:.4f}, "
        f"delta {rq['ppl'] - r['ppl']:+.4f}"
    )
    assert want in (q / "README.md").read_text()

    # another text (or other options): the carried reference does not apply
    other = write_corpus(tmp_path / "other.txt", docs=3, seed=5)
    _ppl(["eval", "ppl", str(q), "--text", str(other), "--record"], capsys)
    assert "reference" not in read_manifest(q).extra["eval"]
    _ppl(["eval", "ppl", str(q), "--text", str(eval_text), "--max-docs", "2", "--record"], capsys)
    assert "reference" not in read_manifest(q).extra["eval"]


@pytest.mark.slow
def test_compare_records_reference_on_the_second(src, eval_text, tmp_path, capsys):
    q = tmp_path / "q"
    quantize_artifact(src, q, scheme="w8a16", algo="rtn")
    before_src = _snapshot(src)
    c = _ppl(["eval", "compare", str(src), str(q), "--text", str(eval_text), "--record"], capsys)
    assert _snapshot(src) == before_src  # only the second artifact is written
    ev = read_manifest(q).extra["eval"]
    assert ev["ppl"] == pytest.approx(c["ppl_b"])
    assert ev["reference"]["ppl"] == pytest.approx(c["ppl_a"])
    assert ev["reference"]["via"] == "eval compare"
    assert ev["tokens"] == c["positions"] - c["docs"]
    assert f"float32 source {c['ppl_a']:.4f}" in (q / "README.md").read_text()


def test_record_refuses_bad_targets(src, eval_text, tmp_path, capsys):
    onnx_file = src / read_manifest(src).model_file
    assert main(["eval", "ppl", str(onnx_file), "--text", str(eval_text), "--record"]) == 2
    assert "not an artifact directory" in capsys.readouterr().err
    # a modified artifact is not re-blessed: the hash check runs before anything is written
    (src / "tokenizer.json").write_text((src / "tokenizer.json").read_text() + " ")
    before = (src / MANIFEST_NAME).read_bytes()
    assert main(["eval", "ppl", str(src), "--text", str(eval_text), "--record"]) == 1
    assert "does not match its sha256" in capsys.readouterr().err
    assert (src / MANIFEST_NAME).read_bytes() == before
