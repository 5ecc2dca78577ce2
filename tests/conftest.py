"""Shared fixtures: the tiny-model zoo (session-cached exports) and the shared data folder."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from specport.core.settings import shared_dir as _shared_dir
from tests import export_cache
from tests.fixtures import TinyZoo

pytest_plugins = ["tests.gc_freeze"]  # long-lived objects kept out of gc.collect()


@pytest.fixture(scope="session")
def shared_path() -> Callable[..., Path]:
    """`shared_path("models", "stories260K")`: that path in the shared data folder (the setting
    SPECPORT_SHARED); the test skips, naming the path, when it is absent."""

    def find(*parts: str | Path) -> Path:
        path = _shared_dir().joinpath(*parts)
        if not path.exists():
            pytest.skip(f"{path} is absent (set SPECPORT_SHARED to the shared data folder)")
        return path

    return find


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that read the shared data folder carry the `shared` mark (`-m "not shared"`)."""
    for item in items:
        if "shared_path" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.shared)


@pytest.fixture(scope="session", autouse=True)
def _shared_exports(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One export per distinct (source, options) for the whole run, across xdist workers."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "export_cache"
    export_cache.set_root(root)
    from specport.exporter import export

    with pytest.MonkeyPatch.context() as patch:  # every export traces a given model once
        patch.setattr(export, "trace_to_onnx", export_cache.cached_trace(export.trace_to_onnx))
        yield
    export_cache.set_root(None)


_ZOOS: list[TinyZoo] = []


@pytest.fixture(scope="session")
def tiny_zoo(tmp_path_factory: pytest.TempPathFactory) -> TinyZoo:
    """Tiny models for every registry architecture; exports are cached for the session."""
    zoo = TinyZoo(tmp_path_factory.mktemp("tiny_zoo"))
    _ZOOS.append(zoo)
    return zoo


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Print the tiny-model export times and verification errors of this session."""
    lines = [line for zoo in _ZOOS for line in zoo.summary()]
    factory = getattr(terminalreporter.config, "_tmp_path_factory", None)
    if factory is not None:  # the controller's basetemp is the workers' shared parent
        reuse = export_cache.reuse_summary(factory.getbasetemp() / "export_cache")
        lines += [reuse] if reuse else []
        lines += export_cache.slowest_builds(factory.getbasetemp() / "export_cache")
    if lines:
        terminalreporter.section("tiny model exports")
        for line in lines:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def tiny_llama_artifact(tiny_zoo: TinyZoo) -> Path:
    """An exported (unfused) tiny Llama artifact: the cheapest real artifact to test against."""
    return tiny_zoo.artifact("llama", fuse=False)
