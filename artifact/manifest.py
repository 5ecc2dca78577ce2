"""The artifact: a directory a model zoo can publish, and the only thing the runtime reads.

Layout::

    ARTIFACT/
      specport.json        manifest (schema below)
      model.onnx           graph (weights external)
      model.onnx.data      weights
      tokenizer.json ...   tokenizer files copied from the source
      genai_config.json    onnxruntime-genai's config (+ model.genai.onnx when it needs its own graph)
      config.json          the transformers config Optimum reads
      README.md            model card generated from the manifest

The manifest is plain JSON so that other tools can read it; `Manifest` is a thin typed view.
Writes are atomic (build in a sibling temp directory, then rename) so an interrupted export
never leaves a half-written artifact behind; loads check schema version and file hashes so a
tampered or truncated file is an error, never silent wrong output.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specport.core.errors import ArtifactError

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1
MANIFEST_NAME = "specport.json"
MODEL_NAME = "model.onnx"
DATA_NAME = "model.onnx.data"


@dataclass
class KVLayout:
    """How the KV cache crosses the graph boundary.

    `concat`: per layer, `past_key_values.{i}.key/value` [B, Hkv, P, Dh] in and
    `present.{i}.key/value` [B, Hkv, P+S, Dh] out (the cache grows by concatenation).
    `shared`: per layer one preallocated buffer [B, Hkv, T, Dh] bound as both past and present
    (written in place by the fused attention), plus `seqlens_k`/`total_sequence_length` inputs.
    """

    layout: str = "concat"
    inputs: list[list[str]] = field(default_factory=list)  # per layer [key, value]
    outputs: list[list[str]] = field(default_factory=list)
    num_heads: list[int] = field(default_factory=list)  # per layer kv heads (k and v share)
    key_dim: list[int] = field(default_factory=list)  # per layer head dim of keys
    value_dim: list[int] = field(default_factory=list)  # per layer head dim of values
    dtype: str = "float32"
    max_length: int | None = None  # buffer length T for `shared`
    # Per layer cache dtype when layers differ (an int8 cache with some layers kept float32 by
    # `quantize --kv-cache int8`); empty: every layer is `dtype`.
    layer_dtypes: list[str] = field(default_factory=list)

    def dtypes(self) -> list[str]:
        """The cache dtype of each layer (key and value share it)."""
        return list(self.layer_dtypes) or [self.dtype] * len(self.num_heads)


@dataclass
class Manifest:
    """Typed view of `specport.json`; `extra` keeps keys written by newer passes untouched."""

    architecture: str
    config: dict[str, Any]
    io: dict[str, list[dict[str, Any]]]
    kv: KVLayout
    source: dict[str, Any] = field(default_factory=dict)
    opset: int = 23
    dtype: str = "float32"
    target: str = "neutral"
    tokenizer: dict[str, Any] = field(default_factory=dict)
    passes: list[dict[str, Any]] = field(default_factory=list)
    quant: dict[str, Any] | None = None
    mtp: dict[str, Any] | None = None
    verify: dict[str, Any] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)
    model_file: str = MODEL_NAME
    schema_version: int = SCHEMA_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        extra = data.pop("extra")
        data.update(extra)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Manifest:
        known = {f for f in cls.__dataclass_fields__ if f != "extra"}
        kwargs = {k: v for k, v in data.items() if k in known}
        kwargs["kv"] = KVLayout(**data.get("kv", {}))
        extra = {k: v for k, v in data.items() if k not in known}
        return cls(**kwargs, extra=extra)

    # Convenience accessors used all over the runtime.
    @property
    def num_layers(self) -> int:
        return int(self.config["num_layers"])

    @property
    def vocab_size(self) -> int:
        return int(self.config["vocab_size"])

    @property
    def context_length(self) -> int:
        return int(self.config["context_length"])

    @property
    def eos_token_ids(self) -> list[int]:
        return [int(t) for t in self.config.get("eos_token_ids") or []]


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def hash_files(directory: Path) -> dict[str, str]:
    """sha256 of every file in the artifact except the manifest itself."""
    out: dict[str, str] = {}
    for p in sorted(directory.rglob("*")):
        if p.is_file() and p.name != MANIFEST_NAME:
            out[p.relative_to(directory).as_posix()] = sha256_file(p)
    return out


def write_manifest(
    directory: Path, manifest: Manifest, files: dict[str, str] | None = None
) -> None:
    """Write `specport.json` with the sha256 of every file in `directory` (``files``: those
    hashes, when the caller has them already).

    This writes only the manifest: an artifact writer calls
    `specport.artifact.files.write_artifact_manifest`, which first writes what other runtimes
    read (genai_config.json, config.json, the README.md model card) and then calls this.
    """
    manifest.files = hash_files(directory) if files is None else files
    (directory / MANIFEST_NAME).write_text(json.dumps(manifest.to_json(), indent=2) + "\n")


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that a reader (or a restart after a crash) sees the old
    file or the whole new one, never a part: a temp file in the same directory, flushed to
    disk (fsync) before it replaces ``path`` in one rename; on any failure it is removed and
    ``path`` is left as it was. An existing file's permission bits are kept."""
    path = Path(path)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    tmp = Path(name)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if path.exists():
            os.chmod(tmp, path.stat().st_mode & 0o777)
        else:  # mkstemp makes 0600; a new file gets the umask's bits, as open() would give
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextmanager
def atomic_artifact_dir(out: Path, overwrite: bool = True) -> Iterator[Path]:
    """Yield a temp directory beside `out`; on success it replaces `out` in one rename.

    On any exception the temp directory is removed and `out` is left as it was.
    """
    out = Path(out).resolve()
    if out.exists() and not overwrite:
        raise ArtifactError(f"{out} already exists; pass --overwrite or choose another --out")
    if out.exists() and not out.is_dir():
        raise ArtifactError(
            f"{out} is an existing file, not an artifact directory; refusing to replace it. "
            "Choose a new --out path."
        )
    if out.exists() and out.is_dir() and any(out.iterdir()) and not (out / MANIFEST_NAME).exists():
        raise ArtifactError(
            f"{out} exists and is not a specport artifact; refusing to replace it. "
            "Choose an empty or new --out directory."
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp: Path | None = None
    try:  # made inside the try: a SIGTERM raised just after mkdtemp still removes it
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes 0700; an artifact is meant to be shared
        yield tmp
        if out.exists():
            trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, trash / "old")
            os.replace(tmp, out)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def read_manifest(directory: str | os.PathLike[str], check_hashes: bool = True) -> Manifest:
    """Load and validate an artifact's manifest.

    Raises ArtifactError naming the problem and the fix for: a missing directory or manifest,
    malformed JSON, a newer schema, a missing file, or a file whose hash does not match.
    """
    d = Path(directory)
    if not d.exists():
        raise ArtifactError(
            f"artifact not found: {d}. Create one with `specport export MODEL --out {d}`."
        )
    if d.is_file() and d.suffix == ".onnx":
        raise ArtifactError(
            f"{d} is a bare ONNX file; specport runs artifact directories. "
            "Use `specport export` to make one, or pass the directory that holds specport.json."
        )
    mpath = d / MANIFEST_NAME
    if not mpath.exists():
        raise ArtifactError(
            f"{d} is not a specport artifact (no {MANIFEST_NAME}). "
            "Create one with `specport export MODEL --out DIR`."
        )
    try:
        data = json.loads(mpath.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArtifactError(
            f"{mpath} is not valid JSON ({e}); the artifact is corrupt, re-export it."
        ) from e
    version = data.get("schema_version")
    if not isinstance(version, int):
        raise ArtifactError(
            f"{mpath} has no schema_version; the artifact is corrupt, re-export it."
        )
    if version > SCHEMA_VERSION:
        raise ArtifactError(
            f"{d} uses manifest schema {version}, newer than this specport understands "
            f"({SCHEMA_VERSION}). Upgrade specport: pip install -U specport."
        )
    try:
        manifest = Manifest.from_json(data)
    except (TypeError, KeyError) as e:
        raise ArtifactError(
            f"{mpath} is missing required fields ({e}); re-export the artifact."
        ) from e
    if check_hashes:
        verify_files(d, manifest)
    return manifest


def refuse_hard_linked_weights(paths: list[Path]) -> None:
    """Refuse, before any work, weight files that onnx_ir will not read.

    The commands that rewrite a graph (quantize, optimize, train-draft, train-mtp, upgrade)
    read it with onnx_ir, which refuses an external-data file with more than one hard link (its
    guard against a model reading a file linked in from elsewhere); copies made with
    ``cp -al`` or ``rsync --link-dest`` share their files that way. onnxruntime runs such an
    artifact, so only these commands check."""
    for path in paths:
        try:
            links = os.stat(path).st_nlink
        except OSError:
            continue  # a missing file has its own error
        if links > 1:
            raise ArtifactError(
                f"{path} has {links} hard links, and onnx_ir, which reads the weights for this "
                "command, refuses hard-linked weight files (a guard against reading a file "
                "linked in from elsewhere). Copies made with `cp -al` or `rsync --link-dest` "
                "share files this way: make a real copy (`cp -r`) and run on that."
            )


def weight_files(directory: Path, manifest: Manifest) -> list[Path]:
    """The artifact's external-data files (the graphs' weights)."""
    return [directory / name for name in manifest.files if name.endswith(".data")]


def verify_files(directory: Path, manifest: Manifest) -> None:
    if not manifest.files:
        raise ArtifactError(f"{directory}/{MANIFEST_NAME} lists no files; re-export the artifact.")
    for name, digest in manifest.files.items():
        p = directory / name
        if not p.exists():
            raise ArtifactError(
                f"artifact file missing: {p}. The artifact is incomplete; re-export or re-download it."
            )
        if sha256_file(p) != digest:
            raise ArtifactError(
                f"artifact file {p} does not match its sha256 in {MANIFEST_NAME} "
                "(modified or truncated). Re-export or re-download the artifact."
            )
