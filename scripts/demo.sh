#!/usr/bin/env bash
# Install specport and run the built-in demo (trains a small model once, ~2 minutes, offline).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q --disable-pip-version-check torch==2.13.0
python -m pip install -q --disable-pip-version-check -e .
specport demo "$@"
