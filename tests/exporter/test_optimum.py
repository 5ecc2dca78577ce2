"""Concat-layout artifacts load in Optimum's ORTModelForCausalLM and generate specport's tokens.

Optimum (optimum-onnx 0.1.0) pins transformers<4.58, so it runs from its own venv through
scripts/check_optimum.py, exactly as a user would run it. The venv is built once (a few minutes
of pip) at $SPECPORT_OPTIMUM_VENV or ~/.cache/specport/optimum-venv; without it the test skips,
unless SPECPORT_OPTIMUM_BUILD=1 asks it to build the venv first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from specport.artifact.manifest import read_manifest
from tests.fixtures import TinyZoo

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "check_optimum.py"
ARCHS = ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gpt2", "deepseek_v3"]


def _venv() -> Path:
    env = os.environ.get("SPECPORT_OPTIMUM_VENV")
    return Path(env) if env else Path.home() / ".cache" / "specport" / "optimum-venv"


def _check(arts: list[Path]) -> list[dict[str, Any]]:
    """scripts/check_optimum.py on `arts`: one result per artifact (skips without a venv)."""
    build = os.environ.get("SPECPORT_OPTIMUM_BUILD") == "1"
    if not (_venv() / "bin" / "python").exists() and not build:
        pytest.skip(
            f"no Optimum venv at {_venv()}: run `python scripts/check_optimum.py --build ART` once "
            "(or set SPECPORT_OPTIMUM_BUILD=1); Optimum pins transformers<4.58"
        )
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, arts), "--venv", str(_venv())]
        + (["--build"] if build else []),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(results) == len(arts), proc.stderr[-2000:]
    return results


@pytest.mark.slow
def test_optimum_generates_specport_tokens(tiny_zoo: TinyZoo) -> None:
    arts = [tiny_zoo.artifact(a, fuse=True) for a in ARCHS] + [tiny_zoo.artifact("llama")]
    results = _check(arts)
    compared = [r for r in results if "skipped" not in r]
    assert all(r["ok"] for r in results), [r for r in results if not r["ok"]]
    # What Optimum runs is what the manifests claim, and each refusal carries its reason.
    for art, r in zip(arts, results):
        optimum = read_manifest(art).extra["interop"]["runtimes"]["optimum"]
        assert ("skipped" in r) == (optimum["status"] != "yes")
        assert optimum["status"] == "yes" or optimum["reason"]
    names = {Path(r["artifact"]).name for r in compared}
    assert {"llama-fused", "llama-plain", "mistral-fused", "qwen2-fused", "gpt2-fused"} <= names
    assert all(len(tokens) == 16 for r in compared for tokens in r["optimum"]["tokens"])


@pytest.mark.slow
@pytest.mark.shared
def test_optimum_reads_the_real_tokenizer(shared_path: Callable[..., Path], tmp_path: Path) -> None:
    """stories260K from its transformers-5 directory: Optimum's transformers 4.x tokenizer gives
    specport's ids (the artifact's tokenizer_config.json is in the form both read)."""
    from tests.export_cache import cached_export

    cached_export(shared_path("models", "stories260K"), tmp_path / "a", progress=False)
    (result,) = _check([tmp_path / "a"])
    assert result["ok"], result
    assert result["optimum"]["encoded"] == [1, 403, 407, 261, 378]
