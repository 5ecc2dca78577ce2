"""Settings read from the environment, in one place."""

from __future__ import annotations

import os
from pathlib import Path

from specport.core.errors import InputError


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


def peer_cache_limit_bytes() -> int:
    """The most disk `specport bench`'s peer conversions may take (`SPECPORT_PEER_CACHE_GB`,
    default 20): older entries are evicted past it, because each is 0.5-5 GB and keys change
    with every new checkpoint."""
    raw = os.environ.get("SPECPORT_PEER_CACHE_GB", "20")
    try:
        gb = float(raw)
    except ValueError:
        gb = -1.0
    if not gb >= 0:
        raise InputError(
            f"SPECPORT_PEER_CACHE_GB={raw!r} is not a size in GB; set it to a number such as 20."
        )
    return int(gb * 1e9)
