"""mkdocs hook: lets the API reference (mkdocstrings, griffe) find specport's subpackages.

griffe loads a package by walking its folder, but specport maps its subpackages from top-level
folders (core/, artifact/, runtime/, ...: pyproject's [tool.setuptools.package-dir]), so
`::: specport.core.errors` would not be found under specport/. Before the build this links the
installed layout into a temporary folder (scripts/installed_layout.py, the same layout
`scripts/lint_imports.sh` checks) and points the Python handler's search path there.
"""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path
from typing import Any

from mkdocs.plugins import event_priority

REPO = Path(__file__).resolve().parents[2]
_trees: list[tempfile.TemporaryDirectory[str]] = []


@event_priority(100)  # before mkdocstrings reads its handlers' options
def on_config(config: Any, **_: Any) -> Any:
    spec = importlib.util.spec_from_file_location(
        "installed_layout", REPO / "scripts" / "installed_layout.py"
    )
    assert spec is not None and spec.loader is not None
    layout = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(layout)
    tree = tempfile.TemporaryDirectory(prefix="specport-layout-")
    _trees.append(tree)
    layout.build(REPO, Path(tree.name))
    handlers = config.plugins["mkdocstrings"].config.handlers
    handlers.setdefault("python", {})["paths"] = [tree.name]
    return config


def on_shutdown(**_: Any) -> None:
    while _trees:
        _trees.pop().cleanup()
