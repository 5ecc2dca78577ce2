"""The bench peers' cache: content keys, least-recently-used eviction under a limit, entries in
use and the newest entry kept, nothing outside the cache touched."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specport.bench import peer_cache
from specport.bench.peer_cache import Entry, content_key, evict
from specport.core.errors import InputError
from specport.core.settings import peer_cache_limit_bytes

MB = 1_000_000


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPECPORT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "peers"


def _entry(cache: Path, kind: str, name: str, size: int, used_ago_s: float, folder: bool) -> Path:
    """A fake finished entry of `size` bytes, last used `used_ago_s` seconds ago."""
    path = cache / kind / name
    path.parent.mkdir(parents=True, exist_ok=True)
    if folder:
        path.mkdir()
        (path / "model.onnx.data").write_bytes(b"\0" * (size - 10))
        (path / "genai_config.json").write_bytes(b"{}" + b" " * 8)
    else:
        path.write_bytes(b"\0" * size)
    stamp = time.time() - used_ago_s
    os.utime(path, (stamp, stamp))
    return path


def _fill(cache: Path) -> dict[str, Path]:
    return {
        "old_gguf": _entry(cache, "llama.cpp", "a-F32.gguf", 3 * MB, 5000, folder=False),
        "old_genai": _entry(cache, "onnxruntime-genai", "b-fp32", 2 * MB, 4000, folder=True),
        "mid_gguf": _entry(cache, "llama.cpp", "c-Q8_0.gguf", 2 * MB, 3000, folder=False),
        "new_genai": _entry(cache, "onnxruntime-genai", "d-int4", 1 * MB, 10, folder=True),
    }


def _total(cache: Path) -> int:
    return sum(p.stat().st_size for p in cache.rglob("*") if p.is_file() and p.suffix != ".lock")


def test_least_recently_used_entries_go_first_until_under_the_limit(
    cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    e = _fill(cache)
    with caplog.at_level(logging.INFO, logger="specport.bench.peer_cache"):
        removed = evict(limit=4 * MB)
    # 8 MB -> drop the oldest (3 MB: 5 MB left), then the next oldest (2 MB: 3 MB left)
    assert removed == [e["old_gguf"], e["old_genai"]]
    assert not e["old_gguf"].exists() and not e["old_genai"].exists()
    assert e["mid_gguf"].exists() and e["new_genai"].exists()
    assert _total(cache) <= 4 * MB
    lines = [r.getMessage() for r in caplog.records if "evicted" in r.getMessage()]
    assert len(lines) == 2 and "a-F32.gguf" in lines[0] and "b-fp32" in lines[1]
    assert all("\n" not in line for line in lines)


def test_nothing_is_evicted_under_the_limit(cache: Path) -> None:
    _fill(cache)
    assert evict(limit=8 * MB) == []
    assert _total(cache) == 8 * MB


def test_the_new_entry_and_entries_in_use_are_kept(cache: Path) -> None:
    e = _fill(cache)
    held = Entry("llama.cpp", "a-F32.gguf")  # the oldest, but a bench is using it
    try:
        removed = evict(keep=e["old_genai"], limit=1 * MB)
    finally:
        held.release()
    assert removed == [e["mid_gguf"], e["new_genai"]]
    assert e["old_gguf"].exists() and e["old_genai"].exists()
    # released: now it can go
    assert evict(keep=e["old_genai"], limit=1 * MB) == [e["old_gguf"]]


def test_an_entry_held_by_another_process_is_kept(cache: Path) -> None:
    pytest.importorskip("fcntl", reason="advisory locks are POSIX-only")
    e = _fill(cache)
    code = (
        "import sys; from specport.bench.peer_cache import Entry\n"
        "h = Entry('llama.cpp', 'a-F32.gguf'); print('held', flush=True); sys.stdin.read()"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=os.environ.copy(),
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "held"
        assert evict(limit=4 * MB) == [e["old_genai"], e["mid_gguf"]]
        assert e["old_gguf"].exists()
    finally:
        child.communicate("")
    assert evict(limit=3 * MB) == [e["old_gguf"]]  # the other process is done with it


def test_using_an_entry_makes_it_recent(cache: Path) -> None:
    e = _fill(cache)
    entry = Entry("llama.cpp", "a-F32.gguf")
    entry.used()
    entry.release()
    assert evict(limit=5 * MB) == [e["old_genai"], e["mid_gguf"]]


def test_a_build_is_atomic_and_a_dead_builders_leftovers_are_removed(cache: Path) -> None:
    entry = Entry("onnxruntime-genai", "k-fp32")
    tmp = entry.temp()
    assert tmp.parent == entry.path.parent and tmp.name.startswith(".")
    tmp.mkdir()
    (tmp / "genai_config.json").write_text("{}")
    assert not entry.ready()  # nothing under the entry's name until the build is whole
    entry.commit(tmp)
    assert entry.ready() and not tmp.exists()
    entry.release()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    leftover = cache / "llama.cpp" / f".x-F32.gguf.tmp{int(dead.stdout)}"
    leftover.parent.mkdir(parents=True, exist_ok=True)
    leftover.write_bytes(b"\0" * 100)
    evict(limit=10 * MB)
    assert not leftover.exists()


def test_only_the_cache_is_ever_deleted(cache: Path, tmp_path: Path) -> None:
    outside = tmp_path / "users-model.gguf"
    outside.write_bytes(b"\0" * MB)
    (cache / "llama.cpp").mkdir(parents=True)
    link = cache / "llama.cpp" / "z-F32.gguf"
    link.symlink_to(outside)
    os.utime(link, (0, 0), follow_symlinks=False)
    _entry(cache, "llama.cpp", "y-F32.gguf", 2 * MB, 0, folder=False)
    evict(limit=0)
    assert outside.read_bytes() == b"\0" * MB  # the link went, the file it points at did not
    with pytest.raises(RuntimeError, match="outside the peers cache"):
        peer_cache._remove(outside)


def test_the_key_follows_the_content_not_the_path_or_time(cache: Path, tmp_path: Path) -> None:
    a = tmp_path / "one" / "model.safetensors"
    a.parent.mkdir()
    a.write_bytes(b"weights" * 1000)
    b = tmp_path / "two" / "model.safetensors"
    b.parent.mkdir()
    shutil.copyfile(a, b)  # a fresh copy: new path, new mtime
    os.utime(b, (1, 1))
    assert content_key([a], "v1") == content_key([b], "v1")
    assert content_key([a], "v1") != content_key([a], "v2")  # converter version is in the key
    b.write_bytes(b"weightz" * 1000)
    assert content_key([a], "v1") != content_key([b], "v1")


def test_the_limit_is_a_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPECPORT_PEER_CACHE_GB", raising=False)
    assert peer_cache_limit_bytes() == 20 * 1000 * MB
    monkeypatch.setenv("SPECPORT_PEER_CACHE_GB", "0.5")
    assert peer_cache_limit_bytes() == 500 * MB
    monkeypatch.setenv("SPECPORT_PEER_CACHE_GB", "lots")
    with pytest.raises(InputError, match="SPECPORT_PEER_CACHE_GB"):
        peer_cache_limit_bytes()
