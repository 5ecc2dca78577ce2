"""Text files as documents: the one reading rule shared by calibration and evaluation.

Both sides must cut a file the same way (blank lines separate documents, surrounding space
is dropped), or the "calibrate on one part, evaluate on the other" split would not be one.
"""

from __future__ import annotations

import os
from pathlib import Path


def split_documents(text: str) -> list[str]:
    """Blank-line separated documents of ``text``; empty ones are dropped."""
    return [d.strip() for d in text.split("\n\n") if d.strip()]


def read_text_documents(path: str | os.PathLike[str]) -> list[str] | None:
    """The documents of a file, or None when there is no such file (callers word the error)."""
    p = Path(path)
    if not p.is_file():
        return None
    return split_documents(p.read_text(encoding="utf-8"))
