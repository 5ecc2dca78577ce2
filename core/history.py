"""The manifest's `history`: every operation that wrote the artifact, in order.

Why: the manifest's `quant` / `passes` sections say what the last step left; a user (and
`inspect`, and the model card) also needs what was done, in which order, from which input. Each
operation that writes an artifact (export, quantize, train-mtp, upgrade) runs inside
`operation(...)`, which sets the entry this write appends; the artifact writer
(`specport.artifact.files.write_artifact_manifest`) calls `stamp` before it writes the model
card. One operation that writes twice (export with --quant quantizes in place) appends once.
`optimize` writes a bare ONNX file: its history goes into the file's metadata (`ONNX_KEY`).

An entry: {command, specport (version), options, time (UTC), input {path, sha256, of}, id}.
An artifact written before history existed has none: `entries` gives [] (no schema change).
"""

from __future__ import annotations

import contextvars
import hashlib
import json
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from specport.core.options import FLAGS

HISTORY_KEY = "history"
ONNX_KEY = "specport.history"
_PENDING: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "specport_history_pending", default=None
)
HEAD_BYTES = 1 << 20  # a big input file is fingerprinted by its size and first/last MiB


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("specport")
    except Exception:  # noqa: BLE001 - a source checkout without metadata
        return "unknown"


def _plain(value: Any) -> Any:
    """JSON-safe options: paths as strings, callables (progress callbacks) dropped."""
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items() if not callable(v)}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def fingerprint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """{path, sha256, of}: an artifact by its manifest (which holds every file's sha256), a model
    directory by its config and weight headers, a file by its size and first/last MiB."""
    p = Path(path)
    h = hashlib.sha256()
    if (p / "specport.json").is_file():
        h.update((p / "specport.json").read_bytes())
        of = "specport.json"
    elif p.is_dir():
        for f in sorted(q for q in p.iterdir() if q.is_file()):
            h.update(f"{f.name}:{f.stat().st_size}\n".encode())
            if f.suffix in (".json", ".safetensors"):
                with open(f, "rb") as fh:
                    h.update(fh.read(HEAD_BYTES))
        of = "file names, sizes, configs and weight headers"
    elif p.is_file():
        size = p.stat().st_size
        with open(p, "rb") as fh:
            h.update(str(size).encode())
            h.update(fh.read(HEAD_BYTES))
            if size > 2 * HEAD_BYTES:
                fh.seek(size - HEAD_BYTES)
            h.update(fh.read(HEAD_BYTES))
        of = "size and first/last MiB" if size > 2 * HEAD_BYTES else "the whole file"
    else:  # a hub id resolved elsewhere
        h.update(str(path).encode())
        of = "the name"
    return {"path": str(path), "sha256": h.hexdigest(), "of": of}


def defaults_of(fn: Any) -> dict[str, Any]:
    """Keyword defaults of `fn`: options equal to them are not recorded (they add no news)."""
    import inspect

    return {
        k: p.default
        for k, p in inspect.signature(fn).parameters.items()
        if p.default is not inspect.Parameter.empty
    }


def make_entry(
    command: str, options: dict[str, Any], source: Any, defaults: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One history entry; `options` equal to `defaults` (or None) are left out."""
    base = _plain(defaults or {})
    kept = {
        k: v
        for k, v in _plain(options).items()
        if v is not None and (k not in base or base[k] != v)
    }
    return {
        "command": command,
        "specport": _version(),
        "options": kept,
        "time": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "input": fingerprint(source),
        "id": uuid.uuid4().hex[:12],
    }


@contextmanager
def operation(
    command: str, source: Any, defaults: dict[str, Any] | None = None, **options: Any
) -> Iterator[dict[str, Any]]:
    """Run the body as one history entry: artifacts written inside it record it once."""
    entry = make_entry(command, options, source, defaults)
    token = _PENDING.set(entry)
    try:
        yield entry
    finally:
        _PENDING.reset(token)


def entries(manifest: Any) -> list[dict[str, Any]]:
    """The manifest's history, oldest first ([] for an artifact written before history)."""
    value = manifest.extra.get(HISTORY_KEY) if hasattr(manifest, "extra") else None
    return [e for e in value if isinstance(e, dict)] if isinstance(value, list) else []


def stamp(manifest: Any) -> None:
    """Append the running operation's entry (once per operation); no operation, no entry."""
    entry = _PENDING.get()
    if entry is None:
        return
    past = entries(manifest)
    if past and past[-1].get("id") == entry["id"]:
        return
    manifest.extra[HISTORY_KEY] = [*past, dict(entry)]


def onnx_history(metadata: dict[str, str]) -> list[dict[str, Any]]:
    """The history stored in a bare ONNX file's metadata (what `optimize` writes)."""
    try:
        value = json.loads(metadata.get(ONNX_KEY, "[]"))
    except ValueError:
        return []
    return [e for e in value if isinstance(e, dict)] if isinstance(value, list) else []


def command_line(entry: dict[str, Any], names_only: bool = False) -> str:
    """`quantize --scheme w4a16 --algo rtn`: the step's command with the options it was given.
    `names_only`: paths shown by their last part (a published card names no machine folders)."""
    flags = []
    for key, value in (entry.get("options") or {}).items():
        off_switch = (FLAGS.get(key) or "").startswith("--no-")
        if key in ("out", "progress") or value in (None, "", [], ()):
            continue
        if value is False and not off_switch:
            continue
        flag = FLAGS.get(key) or "--" + key.replace("_", "-")
        if not flag.startswith("--"):
            continue
        if off_switch:  # a default-on switch: shown only when turned off
            if value is True:
                continue
            value = True
        items = value if isinstance(value, (list, tuple)) else [value]
        if names_only:
            items = [Path(v).name if isinstance(v, str) and os.sep in v else v for v in items]
        flags.append(flag if value is True else f"{flag} {','.join(map(str, items))}")
    return " ".join([str(entry.get("command", "?")), *flags])


def context(entry: dict[str, Any], names_only: bool = False) -> str:
    """`from art/float, 2026-11-27T14:04:26Z, specport 0.1.0`."""
    where = str((entry.get("input") or {}).get("path", "?"))
    if names_only:
        where = Path(where).name or where
    return f"from {where}, {entry.get('time', '?')}, specport {entry.get('specport', '?')}"


def describe(entry: dict[str, Any]) -> str:
    """One line for `inspect`: the command, then where from and when."""
    return f"{command_line(entry)} ({context(entry)})"
