"""The bench peers' conversion cache: content-keyed, written atomically, bounded by size.

`specport bench --peer onnxruntime-genai|llama.cpp` converts the artifact's source model for the
peer once (minutes, and 0.5-5 GB per entry) and keeps it under `cache_dir()/peers/KIND/KEY`.
Three things keep that folder from filling the disk:

- the key comes from what determines the conversion's bytes: the source files' *contents*
  (sha256, computed once per file version and remembered by path, size and mtime), the
  converter's version and the target type. Copying, re-downloading or re-converting the same
  checkpoint reuses the entry instead of adding one;
- an entry is built in a temporary sibling and renamed into place, so a crash leaves no
  half-written entry (and a dead builder's leftovers are removed on the next eviction);
- after an entry is added, the least recently used entries are evicted until the whole peers
  cache is under `peer_cache_limit_bytes()` (`SPECPORT_PEER_CACHE_GB`, default 20). A bench that
  holds an entry keeps a shared `flock` on its lock file, so eviction (which needs the exclusive
  lock) never removes an entry in use, in this process or another.

Only paths under `cache_dir()/peers` are ever deleted.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from specport.artifact.manifest import sha256_file
from specport.core.settings import cache_dir, peer_cache_limit_bytes

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; entries in use are only known in-process
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

_TMP = re.compile(r"^\.(?P<name>.+)\.tmp(?P<pid>\d+)$")
_HASHES = ".hashes.json"
_IN_USE: set[Path] = set()  # entries held by this process (the only guard without fcntl)


def peers_root() -> Path:
    """The folder all peer conversions live in (inside specport's own cache directory)."""

    return cache_dir() / "peers"


class Entry:
    """One cache entry (a file or a directory), held with a shared lock while in use.

    Use: `entry = Entry(kind, name)`; if not `entry.ready()`, build into `entry.temp()` and
    `entry.commit(tmp)`; then `entry.used()`, `evict(keep=entry.path)`, and `entry.release()`
    when the peer is done with it.
    """

    def __init__(self, kind: str, name: str) -> None:
        self.path = peers_root() / kind / name
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock: Any = _hold_shared(_lock_path(self.path))
        _IN_USE.add(self.path)

    def ready(self) -> bool:
        return self.path.exists()

    def temp(self) -> Path:
        """A fresh path beside the entry to build into (this process's own)."""
        tmp = self.path.with_name(f".{self.path.name}.tmp{os.getpid()}")
        _remove(tmp)
        return tmp

    def commit(self, tmp: Path) -> None:
        """Move the built `tmp` into place; if another process got there first, keep theirs."""
        if self.path.exists():
            _remove(tmp)
            return
        os.replace(tmp, self.path)

    def discard(self, tmp: Path) -> None:
        """Drop a build that failed."""
        _remove(tmp)

    def clear(self) -> None:
        """Remove the entry itself (it is incomplete: nobody can be using it)."""
        _remove(self.path)

    def used(self) -> None:
        """Stamp the entry as just used (eviction order; access times are often not kept)."""
        with contextlib.suppress(OSError):
            os.utime(self.path)

    def release(self) -> None:
        _IN_USE.discard(self.path)
        if self._lock is not None:
            self._lock.close()  # closing the file drops its flock
            self._lock = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.release()


def _lock_path(entry: Path) -> Path:
    return entry.with_name(f".{entry.name}.lock")


def _hold_shared(lock: Path) -> Any:
    """An open lock file with a shared flock on it, or None where flock does not exist.

    Retries if an evictor unlinked the lock file between our open and our lock (the lock we got
    would then be on an orphan inode that the next evictor does not see).
    """
    if fcntl is None:
        return None
    while True:
        f = open(lock, "a+b")  # noqa: SIM115 - kept open for as long as the entry is in use
        fcntl.flock(f.fileno(), fcntl.LOCK_SH)
        try:
            if os.fstat(f.fileno()).st_ino == os.stat(lock).st_ino:
                return f
        except FileNotFoundError:
            pass
        f.close()


def _try_exclusive(lock: Path) -> Any:
    """The lock file held exclusively (nobody is using its entry), or None if it is in use."""
    if fcntl is None:
        return open(lock, "a+b")  # noqa: SIM115 - in-process check is done by the caller
    f = open(lock, "a+b")  # noqa: SIM115 - closed by the caller
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        return None
    return f


def _size(path: Path) -> int:
    if path.is_symlink() or path.is_file():
        return path.lstat().st_size
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += (Path(root) / name).lstat().st_size
    return total


def _remove(path: Path) -> None:
    """Delete `path`, which must lie inside the peers cache (never anything of the user's)."""
    root = peers_root().resolve()
    parent = path.parent.resolve()
    if parent != root and root not in parent.parents:
        raise RuntimeError(f"refusing to delete {path}: outside the peers cache {root}")
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.exists():
        shutil.rmtree(path)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists but is someone else's
    return True


def _entries(root: Path) -> list[Path]:
    """Entries of every peer kind (hidden names are temps, locks and the hash memo)."""
    if not root.is_dir():
        return []
    return [
        p
        for kind in root.iterdir()
        if kind.is_dir() and not kind.name.startswith(".")
        for p in kind.iterdir()
        if not p.name.startswith(".")
    ]


def _temps(root: Path) -> list[Path]:
    """Entries being built (`.NAME.tmpPID`), by this or another process."""
    if not root.is_dir():
        return []
    return [
        p for kind in root.iterdir() if kind.is_dir() for p in kind.iterdir() if _TMP.match(p.name)
    ]


def _clear_dead_temps(root: Path) -> None:
    for p in _temps(root):
        pid = int(_TMP.match(p.name)["pid"])  # type: ignore[index]
        if pid != os.getpid() and not _pid_alive(pid):
            logger.info("peer cache: removed %s (left by a build that did not finish)", p)
            _remove(p)


def evict(keep: Path | None = None, limit: int | None = None) -> list[Path]:
    """Remove least recently used entries until the peers cache is under `limit` bytes.

    `keep` (the entry just made or used) and entries in use are never removed. Returns the
    removed paths, oldest first; each removal is logged on one line.
    """

    limit = peer_cache_limit_bytes() if limit is None else limit
    root = peers_root()
    _clear_dead_temps(root)
    sizes = {p: _size(p) for p in _entries(root)}
    total = sum(sizes.values()) + sum(_size(p) for p in _temps(root))  # builds in progress
    removed: list[Path] = []
    for path in sorted(sizes, key=_last_used):
        if total <= limit:
            break
        if path == keep or path in _IN_USE:
            continue
        lock = _try_exclusive(_lock_path(path))
        if lock is None:
            continue  # another bench is using it
        try:
            age_h = (time.time() - _last_used(path)) / 3600
            _remove(path)
            _lock_path(path).unlink(missing_ok=True)
        finally:
            lock.close()
        total -= sizes[path]
        removed.append(path)
        logger.info(
            "peer cache: evicted %s (%.2f GB, last used %.1f h ago) to stay under %.1f GB",
            path,
            sizes[path] / 1e9,
            age_h,
            limit / 1e9,
        )
    if total > limit:
        logger.warning(
            "peer cache: %.2f GB in %s is over its %.1f GB limit with only entries in use left; "
            "raise SPECPORT_PEER_CACHE_GB or free space.",
            total / 1e9,
            root,
            limit / 1e9,
        )
    return removed


def _last_used(path: Path) -> float:
    try:
        return path.lstat().st_mtime
    except OSError:
        return 0.0


def content_key(files: Iterable[Path], *extra: str) -> str:
    """A 16-hex key from the files' names and contents (not their paths or times) plus `extra`
    (converter version, target type): the same checkpoint anywhere gets the same key."""
    h = hashlib.sha256()
    for p in sorted(files, key=lambda p: p.name):
        h.update(f"{p.name}\0{file_sha256(p)}\n".encode())
    for part in extra:
        h.update(f"{part}\n".encode())
    return h.hexdigest()[:16]


def file_sha256(path: Path) -> str:
    """sha256 of `path`, remembered by (path, size, mtime) so each file version is read once."""

    st = path.stat()
    real = str(path.resolve())
    memo_path = peers_root() / _HASHES
    try:
        memo: dict[str, Any] = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    seen = memo.get(real)
    if seen and seen.get("size") == st.st_size and seen.get("mtime_ns") == st.st_mtime_ns:
        return str(seen["sha256"])
    if st.st_size > 1 << 28:
        logger.info("peer cache: hashing %s (%.1f GB, once per file)", path, st.st_size / 1e9)
    digest = sha256_file(path, chunk=1 << 24)
    memo = {k: v for k, v in memo.items() if Path(k).exists()}
    memo[real] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
    memo_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = memo_path.with_name(f"{_HASHES}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(memo, indent=0, sort_keys=True))
    os.replace(tmp, memo_path)
    return digest
