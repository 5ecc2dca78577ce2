#!/usr/bin/env bash
# Install specport with its dev tools, lint, type-check, then run the whole test suite.
# Usage: bash scripts/test.sh [extra pytest args]   (e.g. -m "not slow" for the quick subset)
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q --disable-pip-version-check torch==2.13.0
python -m pip install -q --disable-pip-version-check -e ".[dev,docs,genai,gguf,structured,ray,qnn,openvino]"
ruff check .
ruff format --check .
bash scripts/typecheck.sh  # mypy on the installed layout (every cross-layer call checked)
bash scripts/lint_imports.sh  # the layer contracts in pyproject.toml ([tool.importlinter])
python -m pytest -n 2 --dist loadfile -q "$@"
