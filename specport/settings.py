"""Settings read from the environment, in one place."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where specport keeps what it builds for itself (the demo model)."""
    env = os.environ.get("SPECPORT_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "specport"


def shared_dir() -> Path:
    """The development data folder (real checkpoints, text); tests skip when it is absent."""
    return Path(
        os.environ.get(
            "SPECPORT_SHARED", str(Path(__file__).resolve().parents[1].parent / "shared")
        )
    )
