#!/usr/bin/env bash
# Check the import contracts in pyproject.toml ([tool.importlinter]) with import-linter, and that
# no modules import each other in a cycle (scripts/import_cycles.py).
#
# Why a wrapper: import-linter (grimp) finds a package's modules by walking its directory, but
# specport maps its subpackages from top-level folders (pyproject's [tool.setuptools.package-dir]:
# specport.runtime = runtime/, ...). This builds the installed layout as symlinks in a temp
# folder (specport/ with runtime, passes, ... linked in) and runs lint-imports there.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
tree="$(mktemp -d)"
trap 'rm -rf "$tree"' EXIT
python - "$repo" "$tree" <<'PY'
import sys
import tomllib
from pathlib import Path

repo, tree = Path(sys.argv[1]), Path(sys.argv[2])
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
PY
ln -s "$repo/benchmarks" "$tree/benchmarks"
cd "$tree"  # lint-imports puts the working directory first on sys.path
lint-imports --config "$repo/pyproject.toml" --no-cache "$@"
# No two modules import each other, directly or round a longer loop (the contracts above check
# the direction between layers only); the developer scripts in benchmarks/ are held to it too.
python "$repo/scripts/import_cycles.py" specport benchmarks
