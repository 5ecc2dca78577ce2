"""`specport optimize` end to end on a tiny export (text and --json), and its usage errors."""

from __future__ import annotations

import json

from specport.cli import main


def test_optimize_json(tiny_export, tmp_path, capsys):
    _, path = tiny_export("llama")
    capsys.readouterr()  # drop the exporter's progress lines
    out = tmp_path / "opt.onnx"
    rc = main(["optimize", str(path), "--out", str(out), "--target", "cpu", "--json"])
    assert rc == 0
    info = json.loads(capsys.readouterr().out)
    assert out.exists() and (tmp_path / "opt.onnx.data").exists()
    names = [p["name"] for p in info["passes"]]
    assert names[0] == "normalize" and "fuse_attention" in names
    attn = next(p for p in info["passes"] if p["name"] == "fuse_attention")
    assert attn["matched"] == 2
    assert info["io_contract"]["layout"] == "concat"
    assert "com.microsoft.GroupQueryAttention" in info["ops_after"]
    import onnx

    onnx.checker.check_model(str(out))  # the default cpu lowering stays checker-clean


def test_optimize_text_shared_and_errors(tiny_export, tmp_path, capsys):
    _, path = tiny_export("llama")
    capsys.readouterr()
    out = tmp_path / "shared.onnx"
    rc = main(
        ["optimize", str(path), "--out", str(out), "--kv-layout", "shared", "--max-length", "64"]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "shared_kv" in text and "fuse_attention" in text
    # a missing input and an unknown pass are usage errors: exit 2, before any work
    assert main(["optimize", str(tmp_path / "missing.onnx"), "--out", str(out)]) == 2
    rc = main(["optimize", str(path), "--out", str(out), "--passes", "fuse_all"])
    assert rc == 2 and "unknown pass" in capsys.readouterr().err
