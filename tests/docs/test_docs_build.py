"""The documentation site builds with `mkdocs build --strict` (a broken link, a page missing from
the nav or a docstring mkdocstrings cannot read fails), and its CLI reference, generated from the
parsers by docs/hooks/cli_reference.py, lists every command and every option."""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from specport.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]


def _hook():
    spec = importlib.util.spec_from_file_location(
        "cli_reference", ROOT / "docs/hooks/cli_reference.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _parsers(parser: argparse.ArgumentParser, prog: str = "specport"):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield f"{prog} {name}", child
                yield from _parsers(child, f"{prog} {name}")


def test_cli_reference_lists_every_command_and_option() -> None:
    text = _hook().cli_markdown(build_parser())
    for path, parser in _parsers(build_parser()):
        assert f"`{path}`" in text, path
        for action in parser._actions:
            for flag in action.option_strings:
                if flag.startswith("--") and flag not in ("--help", "--verbose", "--quiet"):
                    assert f"`{flag}`" in text, f"{path} {flag}"


@pytest.mark.slow
def test_mkdocs_build_strict(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-f", str(ROOT / "mkdocs.yml"),
         "-d", str(tmp_path / "site")],
        capture_output=True,
        text=True,
        timeout=900,
        env={"NO_MKDOCS_2_WARNING": "1", **__import__("os").environ},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    cli = (tmp_path / "site/reference/cli/index.html").read_text(encoding="utf-8")
    assert "specport loadtest" in cli and "--plot" in cli
    api = (tmp_path / "site/reference/api/index.html").read_text(encoding="utf-8")
    assert "specport.loading.load" in api
