"""Session-cached tiny exports for the fusion tests (spine contract, see tests/passes/graph_models.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.passes.graph_models import cached_export


@pytest.fixture(scope="session")
def tiny_export(tmp_path_factory: pytest.TempPathFactory):
    """tiny_export(arch, dynamo=True, **config) -> (hf_model, model.onnx path), cached."""
    root = Path(tmp_path_factory.mktemp("fusion_exports"))
    cache: dict[tuple, tuple] = {}

    def get(arch: str, dynamo: bool = True, **overrides):
        key = (arch, dynamo, tuple(sorted(overrides.items())))
        if key not in cache:
            sub = root / "_".join([arch, *(f"{k}{v}" for k, v in sorted(overrides.items()))])
            cache[key] = cached_export(arch, sub, dynamo=dynamo, **overrides)
        return cache[key]

    return get
