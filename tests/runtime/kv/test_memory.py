"""KV buffers on anonymous maps: what a row commits, and handing a row's pages back.

What users rely on: with 4 KiB pages a row costs what was written to it, not its whole length;
a released row's pages really go back to the system (the process's resident memory falls)
while every other row's KV stays as it was; and the page arithmetic admission counts with
(`row_commit`) is never below what the pages hold."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

from specport.runtime.kv.cache import SharedKVCache
from specport.runtime.kv.memory import HUGE_PAGE, SMALL_PAGE, KVBuffer, row_commit

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="page advice: Linux")

# 4 rows, 3 heads, 4,096 positions of 64 fp32 (SmolLM2-135M's per-layer shape): 1 MiB per head
SHAPE = (4, 3, 4096, 64)


def _resident() -> int:
    """The process's resident anonymous memory in bytes."""
    text = Path(f"/proc/{os.getpid()}/status").read_text()
    line = next(x for x in text.splitlines() if x.startswith("RssAnon:"))
    return int(line.split()[1]) * 1024


@linux
def test_small_pages_commit_what_is_written_and_release_gives_it_back():
    before = _resident()
    buf = KVBuffer.allocate(SHAPE, np.dtype(np.float32), small_pages=True)
    buf.array[:, :, :100] = 1.0  # 100 positions of every head of every row
    written = _resident() - before
    whole = buf.array.nbytes
    assert written < whole // 8  # ~1.2 MB of a 12 MiB buffer
    expected = int(row_commit([buf], 100)) * SHAPE[0]
    assert expected >= 4 * 3 * 100 * 64 * 4 and written <= expected + (1 << 20)
    buf.release(1, keep=10)
    buf.release(2, keep=0)
    freed = written - (_resident() - before)
    assert (
        freed
        >= int(row_commit([buf], 100) - row_commit([buf], 10))
        + int(row_commit([buf], 100))
        - 4 * 3 * SMALL_PAGE
    )  # whole pages only: at most a page per head stays
    assert (buf.array[0, :, :100] == 1).all() and (buf.array[3, :, :100] == 1).all()
    assert (buf.array[1, :, :10] == 1).all() and not buf.array[1, :, 16:].any()
    assert not buf.array[2].any()  # released pages read as zeros


def test_row_commit_counts_whole_pages_per_head():
    small = KVBuffer(np.zeros((2, 3, 4096, 64), np.float32), SMALL_PAGE)
    huge = KVBuffer(np.zeros((2, 3, 4096, 64), np.float32), HUGE_PAGE)
    # 1 position: a page per head; 16 positions of 256 bytes fill the page; 17 take two
    assert row_commit([small], [0, 1, 16, 17]).tolist() == [0, 3 * 4096, 3 * 4096, 3 * 8192]
    # on 2 MiB pages the first position commits each head's whole 1 MiB run
    assert row_commit([huge], [0, 1, 4096]).tolist() == [0, 3 << 20, 3 << 20]
    assert int(row_commit([small, small], 4096)) == 2 * small.array[0].nbytes


def test_cache_counts_every_write_and_release_keeps_a_prefix(shared_model):
    """Rows written by a prefill, a decode step (a free row inside the batch is written too),
    a prefix copy and a swap count those positions; a released row keeps `keep` positions."""
    cache = SharedKVCache(shared_model.session, shared_model.manifest, 3, 128, small_pages=True)
    prompt = np.arange(1, 21, dtype=np.int64)
    cache.prefill_rows(0, prompt[None, :], np.array([20]))
    cache.step(np.array([[5], [6]]), np.array([True, False]))
    assert cache.written.tolist() == [21, 1, 0] and cache.lengths.tolist() == [21, 0, 0]
    cache.copy_prefix(0, 2, 21)
    cache.swap(1, 2)
    assert cache.written.tolist() == [21, 21, 21]
    assert (cache.held_bytes() == cache.commit_bytes(21)).all()
    kept = [b[1, :, :10].copy() for b in cache.buffers]
    cache.release(1, keep=10)
    assert cache.lengths[1] == 10 and cache.written[1] == 10
    assert all((b[1, :, :10] == k).all() for b, k in zip(cache.buffers, kept))
    cache.release(2)
    assert cache.lengths[2] == 0 and cache.held_bytes()[2] == 0
