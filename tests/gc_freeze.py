"""Keep Python's cyclic garbage collector off the objects that live for the whole test run.

A test worker holds torch, transformers, the dynamo exporter, onnxruntime and the session's
tiny models: ~600k tracked objects after one export. Every full collection walks all of them,
and `export_model` calls `gc.collect()` three times (it frees the PyTorch weights before
onnxruntime loads its copy: peak memory on real models), ~2 s each in a worker: a cached tiny
export took 10.7 s wall (3.6 s CPU) and 2.9 s (1.0 s CPU) once the long-lived objects were
frozen. So after the session starts and after each test module (its module fixtures torn down),
the garbage is collected and whatever survives is frozen (`gc.freeze`): later collections walk
only what was made since. Reference counting still frees frozen objects; only a cycle among
them outlives its last use, and what is frozen is the run's long-lived state. The product's
own collections are unchanged (test_export_memory measures them in a fresh subprocess).
`-p no:tests.gc_freeze` turns this off (to compare timings).
"""

from __future__ import annotations

import gc
from collections.abc import Generator
from typing import Any

import pytest


def _collect_and_freeze() -> None:
    gc.collect()
    gc.freeze()


@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    _collect_and_freeze()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(
    item: pytest.Item, nextitem: pytest.Item | None
) -> Generator[None, Any, None]:
    yield  # the module's fixtures are finalized when the next test is in another file
    if nextitem is None or nextitem.path != item.path:
        _collect_and_freeze()


def pytest_sessionfinish(session: pytest.Session) -> None:
    gc.unfreeze()  # interpreter shutdown sees every object again
