"""What a user can get wrong, through the real CLI: non-zero exit and a message that helps.

Every case runs `python -m specport ...` in a subprocess and checks the exit code and the
stderr text (the message must name the problem, not dump a traceback). A subprocess that
imports torch costs ~10 s on a busy 2-core machine, so the export cases are `slow` and have
quick in-process twins through `specport.cli.main`.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "specport", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def assert_fails(proc: subprocess.CompletedProcess[str], *needles: str) -> str:
    """Non-zero exit, no traceback, and every needle (case-insensitive) on stderr."""
    err = proc.stderr
    assert proc.returncode != 0, f"expected failure, got 0; stdout={proc.stdout!r}"
    assert "Traceback" not in err, err
    for needle in needles:
        assert needle.lower() in err.lower(), f"{needle!r} not in stderr:\n{err}"
    return err


@pytest.fixture()
def artifact_copy(tiny_llama_artifact: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny Llama artifact that a test may damage."""
    dst = tmp_path / "art"
    shutil.copytree(tiny_llama_artifact, dst)
    return dst


# ---- export: bad source models ---------------------------------------------------------


@pytest.mark.slow
def test_export_missing_path(tmp_path: Path) -> None:
    proc = run_cli("export", str(tmp_path / "no_such_model"), "--out", str(tmp_path / "o"))
    assert_fails(proc, "not found", "no_such_model")
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_export_unknown_architecture_lists_supported(tmp_path: Path) -> None:
    from specport.exporter.registry import supported

    src = tmp_path / "foo_model"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "foo", "hidden_size": 8}))
    proc = run_cli("export", str(src), "--out", str(tmp_path / "o"))
    err = assert_fails(proc, "'foo'", "not supported")
    for name in supported():
        assert name in err


@pytest.mark.slow
def test_export_corrupt_config(tmp_path: Path) -> None:
    src = tmp_path / "broken"
    src.mkdir()
    (src / "config.json").write_text('{"model_type": "llama", "hidden_size": 6')
    proc = run_cli("export", str(src), "--out", str(tmp_path / "o"))
    assert_fails(proc, "config.json", "not valid json")


@pytest.mark.slow
def test_export_truncated_weights(tiny_zoo, tmp_path: Path) -> None:
    src = tmp_path / "truncated"
    shutil.copytree(tiny_zoo.source("llama"), src)
    weights = src / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    proc = run_cli("export", str(src), "--out", str(tmp_path / "o"))
    assert_fails(proc, "could not load weights", "truncated or corrupt")
    assert not (tmp_path / "o").exists()
    assert not list(tmp_path.glob(".o.tmp-*")), "export left a temp directory behind"


@pytest.mark.parametrize(
    ("case", "needles"),
    [
        ("missing", ("not found",)),
        ("foo", ("'foo'", "not supported", "llama", "deepseek_v3")),
        ("corrupt", ("config.json", "not valid json")),
    ],
)
def test_export_errors_in_process(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str, needles: tuple[str, ...]
) -> None:
    from specport.cli import main

    src = tmp_path / "model"
    if case != "missing":
        src.mkdir()
        text = '{"model_type": "foo"}' if case == "foo" else '{"model_type": "llama", "hidden'
        (src / "config.json").write_text(text)
    code = main(["export", str(src), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 1
    for needle in needles:
        assert needle.lower() in err.lower(), err
    assert not (tmp_path / "o").exists()


# ---- generate: damaged artifacts --------------------------------------------------------


def test_generate_tampered_weights(artifact_copy: Path) -> None:
    data = artifact_copy / "model.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    proc = run_cli("generate", str(artifact_copy), "--prompt-ids", "1,2,3")
    assert_fails(proc, "model.onnx.data", "sha256", "re-export")


def test_generate_truncated_artifact(artifact_copy: Path) -> None:
    data = artifact_copy / "model.onnx.data"
    raw = data.read_bytes()
    data.write_bytes(raw[: len(raw) - 100])
    proc = run_cli("generate", str(artifact_copy), "--prompt-ids", "1,2,3")
    assert_fails(proc, "model.onnx.data", "truncated")


def test_generate_missing_artifact_file(artifact_copy: Path) -> None:
    (artifact_copy / "model.onnx.data").unlink()
    proc = run_cli("generate", str(artifact_copy), "--prompt-ids", "1,2,3")
    assert_fails(proc, "missing", "model.onnx.data")


def test_generate_missing_manifest(artifact_copy: Path) -> None:
    (artifact_copy / "specport.json").unlink()
    proc = run_cli("generate", str(artifact_copy), "--prompt-ids", "1,2,3")
    assert_fails(proc, "not a specport artifact", "specport export")


def test_generate_missing_artifact_dir(tmp_path: Path) -> None:
    proc = run_cli("generate", str(tmp_path / "nothing_here"), "--prompt-ids", "1,2,3")
    assert_fails(proc, "artifact not found")


def test_generate_newer_schema(artifact_copy: Path) -> None:
    mpath = artifact_copy / "specport.json"
    manifest = json.loads(mpath.read_text())
    manifest["schema_version"] = manifest["schema_version"] + 1
    mpath.write_text(json.dumps(manifest))
    proc = run_cli("generate", str(artifact_copy), "--prompt-ids", "1,2,3")
    assert_fails(proc, "newer", "upgrade specport")


# ---- generate: bad requests -------------------------------------------------------------


def test_generate_prompt_over_context(tiny_llama_artifact: Path) -> None:
    manifest = json.loads((tiny_llama_artifact / "specport.json").read_text())
    n = int(manifest["config"]["context_length"]) + 5
    ids = ",".join(str(3 + i % 50) for i in range(n))
    proc = run_cli("generate", str(tiny_llama_artifact), "--prompt-ids", ids)
    assert_fails(proc, "context window", f"{n} tokens")


def test_generate_unknown_provider(tiny_llama_artifact: Path) -> None:
    proc = run_cli("generate", str(tiny_llama_artifact), "--prompt-ids", "1,2", "--provider", "tpu")
    assert proc.returncode == 2  # a usage error: argparse names the choices
    assert_fails(proc, "--provider", "'tpu'", "cpu")


def test_generate_unavailable_provider(tiny_llama_artifact: Path) -> None:
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip(
            "this onnxruntime has the CUDA provider; the 'unavailable' case needs a CPU build"
        )
    proc = run_cli(
        "generate", str(tiny_llama_artifact), "--prompt-ids", "1,2", "--provider", "cuda"
    )
    assert_fails(proc, "'cuda'", "not available", "onnxruntime-gpu")


@pytest.mark.parametrize(
    ("ids", "needle"),
    [
        ("1,a,3", "comma-separated integers"),
        (",", "empty"),
        ("1,99999", "outside this model's vocabulary"),
        ("1,-4", "outside this model's vocabulary"),
    ],
)
def test_generate_bad_prompt_ids(tiny_llama_artifact: Path, ids: str, needle: str) -> None:
    proc = run_cli("generate", str(tiny_llama_artifact), f"--prompt-ids={ids}")
    assert_fails(proc, needle)


def test_generate_text_prompt_without_tokenizer(tiny_llama_artifact: Path) -> None:
    proc = run_cli("generate", str(tiny_llama_artifact), "--prompt", "hello")
    assert_fails(proc, "tokenizer", "--prompt-ids")


def test_json_mode_reports_error_as_json(tmp_path: Path) -> None:
    proc = run_cli("generate", str(tmp_path / "nothing_here"), "--prompt-ids", "1", "--json")
    assert proc.returncode != 0
    payload = json.loads(proc.stdout.strip().splitlines()[-1])
    assert payload["type"] == "ArtifactError"
    assert "artifact not found" in payload["error"]
