"""Helpers for the CLI tests: run `specport` in-process, snapshot the user's files, and a
tiny chat artifact (the tiny Llama with a ChatML tokenizer and template)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from specport.cli import main
from tests.fixtures import add_chat_tokenizer, llama_config


def run_cli(capsys: pytest.CaptureFixture[str], *args: Any) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `specport ARGS`; argparse's SystemExit counts too."""
    try:
        code = main([str(a) for a in args])
    except SystemExit as e:
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def snapshot(*roots: Path) -> dict[str, str]:
    """sha256 of every file (and the name of every directory) under `roots`."""
    seen: dict[str, str] = {}
    for root in roots:
        paths = [root, *sorted(root.rglob("*"))] if root.is_dir() else [root]
        for p in paths:
            if p.is_file():
                seen[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
            elif p.is_dir():
                seen[str(p)] = "dir"
    return seen


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Callable[..., tuple[int, str, str]]:
    return lambda *args: run_cli(capsys, *args)


@pytest.fixture
def files() -> Callable[..., dict[str, str]]:
    """`files(*paths)`: a snapshot to compare before/after a command (nothing may change)."""
    return snapshot


@pytest.fixture
def config_only_model(tmp_path: Path) -> Path:
    """A Hugging Face model directory with config.json and no weights: whatever a command
    reports about it must have been found before loading weights."""
    d = tmp_path / "config-only"
    d.mkdir()
    llama_config().save_pretrained(str(d))
    return d


@pytest.fixture(scope="session")
def tiny_chat_artifact(tiny_llama_artifact: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return add_chat_tokenizer(tiny_llama_artifact, tmp_path_factory.mktemp("chat") / "art")
