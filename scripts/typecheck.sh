#!/usr/bin/env bash
# Type-check specport as it installs. Run on the source folders, mypy sees `specport.runtime`,
# `specport.core`, ... (mapped from top-level folders in pyproject's package-dir) only as
# untyped imports, so calls across the layers went unchecked; in the installed layout every
# import between them is checked.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
tree=$(mktemp -d)
trap 'rm -rf "$tree"' EXIT
python scripts/installed_layout.py "$repo" "$tree"
cd "$tree"
mypy --config-file "$repo/pyproject.toml" -p specport
