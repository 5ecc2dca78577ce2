"""Huge-page backing of a session's weights: only memory allocated since the snapshot is
touched, large buffers really end up on 2 MB pages where the kernel allows, and a session
computes the same numbers with or without it."""

from __future__ import annotations

import mmap
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from specport.runtime import hugepages as H


def test_new_spans_keep_only_what_appeared_or_grew():
    before = [(0x1000, 0x5000), (0x9000, 0xA000)]
    after = [(0x1000, 0x8000), (0x9000, 0xA000), (0x20000, 0x30000)]
    # the first mapping grew from 0x5000 to 0x8000; the last one is new; the middle is unchanged
    assert H.new_spans(before, after) == [(0x5000, 0x8000), (0x20000, 0x30000)]
    assert H.new_spans([], after) == after
    assert H.new_spans(after, after) == []


def _anon_huge_kb() -> int:
    text = Path(f"/proc/{os.getpid()}/smaps_rollup").read_text()
    line = next(x for x in text.splitlines() if x.startswith("AnonHugePages:"))
    return int(line.split()[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages: Linux")
def test_a_large_new_buffer_is_collapsed_into_huge_pages():
    if not H.available():
        pytest.skip("transparent huge pages are switched off on this machine")
    pages = H.HugePages()
    # 64 MB of anonymous memory on 4 KB pages, allocated after the snapshot (an mmap, as
    # malloc makes for big buffers; numpy's own allocator would already ask for huge pages)
    buf = mmap.mmap(-1, 64 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = np.frombuffer(buf, dtype=np.uint8)
    view[:] = 1
    huge_before = _anon_huge_kb()
    done = pages.apply()
    if done == 0:
        pytest.skip("the kernel did not collapse (MADV_COLLAPSE needs Linux >= 6.1)")
    assert done >= 32 << 20 and _anon_huge_kb() >= huge_before + (32 << 10)
    assert int(view.sum(dtype=np.int64)) == 64 << 20  # contents survive the collapse
    del view
    buf.close()


def test_session_numbers_do_not_change(tiny_llama_artifact):
    from specport.artifact.manifest import read_manifest
    from specport.runtime.generator import Generator
    from specport.runtime.session import SessionConfig, make_session

    manifest = read_manifest(tiny_llama_artifact)
    tokens = []
    for huge in (False, True):
        config = SessionConfig(provider="cpu", intra_op_threads=1, huge_pages=huge)
        session, _ = make_session(tiny_llama_artifact / manifest.model_file, config)
        assert config.describe()["huge_pages"] is huge
        out = Generator(session, manifest).generate([[1, 5, 9, 14]], 8, eos_ids=())
        tokens.append(out.tokens)
    assert tokens[0] == tokens[1]


def test_environment_turns_huge_pages_off(monkeypatch):
    from specport.runtime.session import SessionConfig

    monkeypatch.delenv("SPECPORT_HUGE_PAGES", raising=False)
    assert SessionConfig().huge_pages
    monkeypatch.setenv("SPECPORT_HUGE_PAGES", "0")
    assert not SessionConfig().huge_pages
    assert SessionConfig(huge_pages=True).huge_pages  # an explicit choice wins
