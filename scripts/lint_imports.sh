#!/usr/bin/env bash
# Check the import contracts in pyproject.toml ([tool.importlinter]) with import-linter, and that
# no modules import each other in a cycle (scripts/import_cycles.py).
#
# Why a wrapper: import-linter (grimp) finds a package's modules by walking its directory, but
# specport maps its subpackages from top-level folders (pyproject's [tool.setuptools.package-dir]:
# specport.core = core/, specport.runtime = runtime/, ...). This builds the installed layout as
# symlinks in a temp folder (scripts/installed_layout.py) and runs lint-imports there.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
tree="$(mktemp -d)"
trap 'rm -rf "$tree"' EXIT
python "$repo/scripts/installed_layout.py" "$repo" "$tree"
ln -s "$repo/benchmarks" "$tree/benchmarks"
cd "$tree"  # lint-imports puts the working directory first on sys.path
lint-imports --config "$repo/pyproject.toml" --no-cache "$@"
# No two modules import each other, directly or round a longer loop (the contracts above check
# the direction between layers only); the developer scripts in benchmarks/ are held to it too.
python "$repo/scripts/import_cycles.py" specport benchmarks
