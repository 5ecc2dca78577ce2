"""A tiny shared-KV Llama (head_dim 16) exported once per session for the engine tests."""

from __future__ import annotations

from pathlib import Path

import pytest

import specport
from tests.fixtures import TINY, make_llama


@pytest.fixture(scope="session")
def shared_model(tmp_path_factory: pytest.TempPathFactory) -> specport.api.Model:
    from tests.export_cache import cached_export

    # initializer_range 0.2: greedy output walks through varied tokens instead of a short loop
    hf = make_llama(
        tmp_path_factory.mktemp("engine_hf"),
        context_length=128,
        initializer_range=0.2,  # type: ignore[arg-type]
        **TINY,
    )
    out: Path = tmp_path_factory.mktemp("engine_shared") / "art"
    cached_export(hf, out, kv_layout="shared", progress=False)
    return specport.load(out, provider="cpu", threads=1)
