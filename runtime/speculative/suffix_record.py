"""Keeping what suffix drafting learned: every learned answer appended to a corpus file.

A server (or chat) with `--speculative suffix` adds each finished answer to the model's
`SuffixIndex`; that index lives in memory and is gone on restart. `--suffix-record FILE` also
appends each learned answer to FILE as one JSON line (``{"ids": [...]}``, the format
`suffix_corpus.read_corpus` reads), so `--suffix-corpus FILE` on the next start restores it;
passing the same FILE as both is the natural setup (a missing or empty FILE is then simply
an empty start).

Appending never rewrites what FILE holds. The writes happen on a small background thread so a
slow disk never stalls decoding, each line is one ``write`` on an ``O_APPEND`` descriptor (so
Ray replicas recording to one file do not interleave lines), and an ``OSError`` logs one
warning and stops recording instead of failing requests.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specport.core.errors import InputError
from specport.runtime.speculative.suffix_corpus import parse_line

logger = logging.getLogger(__name__)


def check_record(path: str | os.PathLike[str]) -> int:
    """Before loading anything: FILE must be missing (it is created) or a corpus of JSON lines
    (``"ids"`` or ``"text"``). Returns the largest token id it holds (-1 if none), for
    `SuffixRecorder.attach` to check against the model's vocabulary."""
    target = Path(path)
    if not target.exists():
        if not target.parent.is_dir():
            raise InputError(f"--suffix-record {target}: folder {target.parent} does not exist.")
        return -1
    if not target.is_file():
        raise InputError(f"--suffix-record {target} is not a file; give a JSON-lines file.")
    largest = -1
    try:
        with target.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, 1):
                if line.strip():
                    largest = max(largest, _largest_id(line, f"--suffix-record {target}:{number}"))
    except UnicodeDecodeError:
        raise InputError(
            f"--suffix-record {target} is not UTF-8 JSON lines; give a corpus file or a new path."
        ) from None
    except OSError as e:
        raise InputError(f"--suffix-record {target}: cannot read it ({e.strerror or e}).") from None
    return largest


def _largest_id(line: str, where: str) -> int:
    """The largest id of a corpus line (-1 for a text line: the tokenizer's ids are in range)."""
    parsed = parse_line(line, where)
    return max(parsed, default=-1) if isinstance(parsed, list) else -1


def corpus_to_read(corpus: str | None, record: str | None) -> str | None:
    """The `--suffix-corpus` to load: None when it is the record file and that is still
    missing or empty (the first start of `--suffix-corpus F --suffix-record F`)."""
    if corpus is None or record is None:
        return corpus
    if Path(corpus).resolve() != Path(record).resolve():
        return corpus
    if not Path(corpus).is_file():
        return None
    with Path(corpus).open("rb") as lines:
        return corpus if any(line.strip() for line in lines) else None


class SuffixRecorder:
    """Appends answers (`__call__`, from `SuffixIndex.learn_answer`) to a JSON-lines file."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as e:
            raise InputError(
                f"--suffix-record {self.path}: cannot append to it ({e.strerror or e})."
            ) from None
        try:  # a last line without its newline would swallow the first answer
            if os.fstat(self._fd).st_size and not _ends_with_newline(self.path):
                os.write(self._fd, b"\n")
        except OSError:
            pass
        self.recorded = 0  # lines written (read by tests and logs)
        self._failed = False
        self._closed = False
        self._queue: queue.SimpleQueue[list[int] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._write_lines, name="suffix-record", daemon=True)
        self._thread.start()

    @classmethod
    def attach(cls, model: Any, path: str | os.PathLike[str], largest_id: int) -> SuffixRecorder:
        """Record every answer `model.suffix_index` learns to `path` (checked by `check_record`,
        which found `largest_id`)."""
        vocab = int(model.manifest.vocab_size)
        if largest_id >= vocab:
            raise InputError(
                f"--suffix-record {path} holds token id {largest_id}, outside this model's "
                f"vocabulary (0..{vocab - 1}): it was recorded from another model; give a new path."
            )
        recorder = cls(path)
        model.suffix_index.recorder = recorder
        logger.info("recording learned answers to %s", path)
        return recorder

    def __call__(self, answer: Sequence[int]) -> None:
        if not self._failed and not self._closed and len(answer):
            self._queue.put([int(t) for t in answer])

    def close(self, timeout_s: float = 10.0) -> None:
        """Write what is queued, then close the file (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _write_lines(self) -> None:
        try:
            while (answer := self._queue.get()) is not None:
                if self._failed:
                    continue
                line = (json.dumps({"ids": answer}) + "\n").encode("utf-8")
                try:
                    _write_all(self._fd, line)
                    self.recorded += 1
                except OSError as e:
                    self._failed = True
                    logger.warning(
                        "--suffix-record %s: cannot append (%s); answers are no longer recorded",
                        self.path,
                        e.strerror or e,
                    )
        finally:
            os.close(self._fd)


def _ends_with_newline(path: Path) -> bool:
    with path.open("rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def _write_all(fd: int, data: bytes) -> None:
    """One ``write`` per line (a regular file takes it whole); loop only on a short write."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
