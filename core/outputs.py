"""Where a command may write: checked in a moment, before any long work starts.

specport replaces only what it wrote itself (an artifact directory, an ONNX file it
optimized) and never a user's file, an input of the same command, or a directory of other
files. Each check names the fix. Writes themselves are atomic (see `specport.artifact`), so
these checks are about *which* path, not about half-written files.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

from specport.core.errors import OutputError, UsageError
from specport.core.options import option

MANIFEST_NAME = "specport.json"  # = artifact.manifest.MANIFEST_NAME (the core sits below it)
OPTIMIZED_MARK = "specport.optimize"  # metadata key `specport optimize` writes into its output


def _resolve(p: str | os.PathLike[str]) -> Path:
    return Path(p).expanduser().resolve()


def check_not_input(
    out: Path, inputs: Iterable[str | os.PathLike[str] | None], flag: str | None = None
) -> None:
    """Refuse an output that is, contains, or lies inside one of the command's inputs."""
    flag = flag or option("out")
    o = _resolve(out)
    for given in inputs:
        if given is None or not Path(given).expanduser().exists():
            continue
        i = _resolve(given)
        if o == i:
            raise UsageError(
                f"{flag} {out} is the input {given}: it would be replaced by the output. "
                f"Choose a new {flag} path."
            )
        if i.is_relative_to(o):
            raise UsageError(
                f"{flag} {out} contains the input {given}: replacing it would delete the input. "
                f"Choose a {flag} outside it."
            )
        if i.is_dir() and o.is_relative_to(i):
            raise UsageError(
                f"{flag} {out} lies inside the input {given}; choose a {flag} outside it "
                "(writing into an input would change it)."
            )


def _check_parent(o: Path, flag: str) -> None:
    """The folder that will hold `o` exists (or can be made) and takes new entries: probed by
    making and removing a temp directory there (permission bits say nothing to root)."""
    parent = o.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise OutputError(
            f"cannot write {flag} {o}: {parent} is a file, not a directory. Choose another {flag}."
        )
    try:
        probe = tempfile.mkdtemp(prefix=".specport-probe-", dir=parent)
        os.rmdir(probe)
    except OSError as e:
        raise OutputError(
            f"cannot write {flag} {o}: {parent} does not take new files ({e.strerror or e}). "
            f"Choose a {flag} in a folder you can write to."
        ) from None


def check_artifact_out(
    out: str | os.PathLike[str],
    inputs: Iterable[str | os.PathLike[str] | None] = (),
    flag: str | None = None,
) -> Path:
    """An artifact directory may be written at `out`: new, empty, or an artifact to replace."""
    flag = flag or option("out")
    o = _resolve(out)
    check_not_input(Path(out), inputs, flag)
    if o.exists() or o.is_symlink():
        if not o.is_dir():
            raise OutputError(
                f"{flag} {out} is an existing file, not an artifact directory; refusing to "
                f"replace it. Choose a new {flag} path, or remove the file yourself."
            )
        if any(o.iterdir()) and not (o / MANIFEST_NAME).is_file():
            raise OutputError(
                f"{flag} {out} is a directory with other files in it (no {MANIFEST_NAME}); "
                f"refusing to replace it. Choose an empty or new {flag} directory."
            )
        _check_parent(o, flag)  # replacing renames in the parent
        return o
    _check_parent(o, flag)
    return o


def onnx_data_path(out: Path) -> Path:
    """Where `specport optimize` puts OUT.onnx's weights."""
    return out.with_name(out.name + ".data")


def check_onnx_out(
    out: str | os.PathLike[str],
    inputs: Iterable[str | os.PathLike[str] | None] = (),
    flag: str | None = None,
) -> Path:
    """An ONNX file (and its OUT.data) may be written: new, or an earlier `specport optimize`
    output (marked in its metadata); never a user's file or one of the inputs."""
    flag = flag or option("out")
    o = _resolve(out)
    data = onnx_data_path(o)
    inputs = list(inputs)
    check_not_input(Path(out), inputs, flag)
    check_not_input(data, inputs, f"{flag} weights file")
    if o.suffix != ".onnx":
        raise UsageError(f"{flag} {out} must end in .onnx (its weights go to {data.name}).")
    if o.exists() or o.is_symlink():
        if o.is_dir():
            raise OutputError(f"{flag} {out} is a directory; give a file path ending in .onnx.")
        if not _optimized_by_specport(o):
            raise OutputError(
                f"{flag} {out} already exists and was not written by `specport optimize`; "
                f"refusing to replace it. Choose a new {flag} path, or remove the file yourself."
            )
    elif data.exists():
        raise OutputError(
            f"{data} already exists (the weights file {flag} {out} would write); refusing to "
            f"replace it. Choose another {flag}."
        )
    _check_parent(o, flag)
    return o


def _optimized_by_specport(path: Path) -> bool:
    try:
        import onnx

        proto = onnx.load(str(path), load_external_data=False)
    except Exception:  # noqa: BLE001 - not ONNX at all: certainly not ours
        return False
    return any(p.key == OPTIMIZED_MARK for p in proto.metadata_props)
