"""Session fixtures for the quantization tests: a tiny Llama artifact with a tokenizer and a
small calibration corpus."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.passes.quant._tiny import with_tokenizer, write_corpus


@pytest.fixture(scope="session")
def quant_src(tiny_llama_artifact: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The plain tiny Llama artifact (2 layers, hidden 64, vocab 256) plus tokenizer.json."""
    return with_tokenizer(tiny_llama_artifact, tmp_path_factory.mktemp("quant") / "src")


@pytest.fixture(scope="session")
def calib_text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("calib") / "calib.txt", docs=24, seed=0)


@pytest.fixture(scope="session")
def eval_text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("evaltext") / "eval.txt", docs=12, seed=1)
