"""Build specport's installed layout as symlinks: a folder `specport/` with core/, runtime/, ... in it.

Why: tools that find a package's modules by walking its folder (grimp, for import-linter and
scripts/import_cycles.py; griffe, for the API reference pages) see only specport/, but
pyproject maps the subpackages from top-level folders ([tool.setuptools.package-dir]:
specport.core = core/, specport.runtime = runtime/, ...). In the folder this builds, `specport`
reads as it does installed, every file a link to the checkout's own.

Usage: python scripts/installed_layout.py REPO TREE   (TREE: an empty folder)
"""

from __future__ import annotations

import sys
from pathlib import Path

import tomllib


def build(repo: Path, tree: Path) -> Path:
    """Link the package's folders under `tree`/specport as pyproject maps them; returns it."""
    dirs = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    top = tree / "specport"
    top.mkdir()
    for child in (repo / dirs["specport"]).iterdir():
        if child.name != "__pycache__":
            (top / child.name).symlink_to(child)
    for name, folder in dirs.items():
        parts = name.split(".")
        if len(parts) == 2 and not (top / parts[1]).exists():
            (top / parts[1]).symlink_to(repo / folder)
    return top


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__.split("\n\n")[-1])
    build(Path(sys.argv[1]).resolve(), Path(sys.argv[2]))
