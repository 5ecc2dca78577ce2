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
from pathlib import Path

import pytest

from specport.artifact import read_manifest
from tests.fixtures import TinyZoo

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "check_optimum.py"
ARCHS = ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gpt2", "deepseek_v3"]


def _venv() -> Path:
    env = os.environ.get("SPECPORT_OPTIMUM_VENV")
    return Path(env) if env else Path.home() / ".cache" / "specport" / "optimum-venv"


@pytest.mark.slow
def test_optimum_generates_specport_tokens(tiny_zoo: TinyZoo) -> None:
    build = os.environ.get("SPECPORT_OPTIMUM_BUILD") == "1"
    if not (_venv() / "bin" / "python").exists() and not build:
        pytest.skip(
            f"no Optimum venv at {_venv()}: run `python scripts/check_optimum.py --build ART` once "
            "(or set SPECPORT_OPTIMUM_BUILD=1); Optimum pins transformers<4.58"
        )
    arts = [tiny_zoo.artifact(a, fuse=True) for a in ARCHS] + [tiny_zoo.artifact("llama")]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, arts), "--venv", str(_venv())]
        + (["--build"] if build else []),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(results) == len(arts), proc.stderr[-2000:]
    compared = [r for r in results if "skipped" not in r]
    assert all(r["ok"] for r in results), [r for r in results if not r["ok"]]
    # What Optimum runs is what the manifests claim, and each refusal carries its reason.
    for art, r in zip(arts, results):
        optimum = read_manifest(art).extra["interop"]["runtimes"]["optimum"]
        assert ("skipped" in r) == (optimum["status"] != "yes")
        assert optimum["status"] == "yes" or optimum["reason"]
    names = {Path(r["artifact"]).name for r in compared}
    assert {"llama-fused", "llama-plain", "mistral-fused", "qwen2-fused", "gpt2-fused"} <= names
    assert all(len(tokens) == 16 for r in compared for tokens in r["optimum"])
