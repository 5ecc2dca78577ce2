"""One export per distinct (source, options) per test run, shared by every xdist worker.

Exporting even a tiny model costs ~10 s (torch's dynamo exporter), and many test modules need
the same tiny artifact: the same random Llama in the shared layout, with a tree mask, as a
1-layer self-draft... `cached_export(src, out, **kwargs)` takes `export_model`'s arguments,
builds the artifact once under the run's shared temporary folder (keyed by the source's bytes
and the options; a file lock makes the other workers wait instead of exporting again) and
copies it to `out`, so a test may still modify its copy. The manifest's `source.path` is set to
the caller's source, as `export_model(src, out)` would have written it.

Tests of the exporter itself (progress, signals, memory, verification) call `export_model`
directly: the cache is for tests that need an artifact, not for tests of exporting.

Beneath it, `cached_trace` stands in for the exporter's `trace_to_onnx` for the run: the same
tiny model is exported by many test files with different options (concat / shared / standard /
qnn target, fp16, quantized, tree mask), and every one of them used to trace it again, although
the traced graph depends only on the PyTorch model (its class, config, weights and buffers) and
on whether the tree mask is traced. The graph is traced once per such key, saved, and every
export loads its own copy of the saved graph; the passes, verification against PyTorch and
everything after the trace still run per export. A streamed export (the model holds no
weights; they are read from the checkpoint when written) is keyed by the checkpoint's files.
Models over `TRACE_CACHE_MAX_PARAMS` are traced as usual.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from filelock import FileLock

_ROOT: Path | None = None  # set for the session by tests/conftest.py
TRACE_CACHE_MAX_PARAMS = 20_000_000  # bigger models (SmolLM2) are traced once per run anyway
TRACE_USES = "trace_uses.txt"
BUILDS = "builds.tsv"  # seconds, kind, source, the test that built it


def set_root(root: Path | None) -> None:
    """Where cached exports live this run (None: export every time)."""
    global _ROOT
    _ROOT = root


def source_digest(src: Path, skip: tuple[str, ...] = ()) -> str:
    """A hash of a source file or of every file under a source folder (names and bytes)."""
    h = hashlib.sha256()
    files = [src] if src.is_file() else sorted(p for p in src.rglob("*") if p.is_file())
    files = [p for p in files if p.name not in skip]
    for path in files:
        h.update(str(path.relative_to(src) if path != src else path.name).encode())
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
    return h.hexdigest()


def cached_export(src: str | os.PathLike[str], out: str | os.PathLike[str], **kwargs: Any) -> Any:
    """`export_model(src, out, **kwargs)`, built once per run and copied; returns the Manifest."""
    from specport.artifact.manifest import read_manifest
    from specport.exporter.export import export_model

    src, out = Path(src), Path(out)
    kwargs.setdefault("progress", False)
    if _ROOT is None or not src.exists():
        return export_model(src, out, **kwargs)
    options = {k: repr(v) for k, v in sorted(kwargs.items()) if k != "progress"}
    built = _build_once(
        source_digest(src) + json.dumps(options, sort_keys=True),
        lambda art: export_model(src, art, **kwargs),
        str(src),
    )
    shutil.copytree(built / "art", out, dirs_exist_ok=True)
    _retarget_source(out, (built / "source.txt").read_text(), src)
    return read_manifest(out, check_hashes=False)


def cached_mtp(
    base: str | os.PathLike[str],
    out: str | os.PathLike[str],
    heads: int = 2,
    seed: int = 0,
    report: dict[str, Any] | None = None,
) -> Any:
    """``base`` with ``heads`` untrained MTP heads (``torch.manual_seed(seed)``, warm-started from
    the base model as ``MTPHeads`` does) spliced in, as ``write_mtp_artifact`` writes it: built
    once per run for each base model's bytes, then copied to ``out``. Returns the Manifest."""
    import torch

    from specport.artifact.manifest import read_manifest
    from specport.exporter.mtp_artifact import write_mtp_artifact
    from specport.exporter.mtp_heads import MTPHeads
    from specport.train.mtp_train import load_base

    base, out = Path(base), Path(out)
    report = {"source": "test"} if report is None else report

    def write(art: Path) -> None:
        torch.manual_seed(seed)
        mtp = MTPHeads(load_base(read_manifest(base)), heads).eval()
        write_mtp_artifact(base, mtp, art, report)

    if _ROOT is None:
        write(out)
    else:
        key = f"mtp {source_digest(base, skip=('specport.json',))} {heads} {seed} {report!r}"
        built = _build_once(key, write, str(base))
        shutil.copytree(built / "art", out, dirs_exist_ok=True)
    return read_manifest(out, check_hashes=False)


def cached_trace(trace: Any) -> Any:
    """A stand-in for ``trace_to_onnx`` (``trace``) that traces each distinct model once per run."""

    def traced(
        torch_model: Any,
        kv_shapes: list[tuple[int, int, int]],
        vocab_size: int,
        tree_mask: bool = False,
        checkpoint: Any = None,
        bindings: Any = None,
    ) -> Any:
        root = _ROOT
        key = None if root is None else _model_key(torch_model, checkpoint)
        if key is None or root is None:
            return trace(torch_model, kv_shapes, vocab_size, tree_mask, checkpoint, bindings)
        import onnx_ir as ir

        def build(folder: Path) -> None:
            folder.mkdir(parents=True)
            model = trace(torch_model, kv_shapes, vocab_size, tree_mask, checkpoint, bindings)
            ir.save(model, folder / "traced.onnx", external_data="traced.onnx.data")

        key += f" {kv_shapes!r} {vocab_size} {tree_mask}"
        built = _build_once("trace " + key, build, type(torch_model).__name__)
        with (root / TRACE_USES).open("a") as uses:  # for the run's summary (reuse_summary)
            uses.write(built.name + "\n")
        return ir.load(built / "art" / "traced.onnx")

    return traced


def reuse_summary(root: Path) -> str | None:
    """'traced N models for M exports' for the run whose cache is ``root`` (None: none traced)."""
    uses_file = root / TRACE_USES
    if not uses_file.is_file():
        return None
    uses = uses_file.read_text().split()
    return f"traced {len(set(uses))} tiny models once for {len(uses)} exports"


def slowest_builds(root: Path, count: int = 15) -> list[str]:
    """The run's costliest cached builds (traces and exports), with the test that paid each."""
    log = root / BUILDS
    if not log.is_file():
        return []
    rows = [line.split("\t") for line in log.read_text().splitlines() if line.count("\t") == 3]
    rows.sort(key=lambda r: -float(r[0]))
    total = sum(float(r[0]) for r in rows)
    lines = [f"{len(rows)} cached builds, {total:.0f} s (an export includes its trace); slowest:"]
    return lines + [
        f"{float(s):7.1f}s {kind:<6} {Path(src).name:<24} {test}"
        for s, kind, src, test in rows[:count]
    ]


def _model_key(torch_model: Any, checkpoint: Any) -> str | None:
    """What the traced graph depends on: the model's class and config, and its weights: every
    parameter and buffer, or with ``checkpoint`` (a streamed export: the model holds no weights)
    the checkpoint's files. None: too big to be worth caching."""
    import torch

    tensors = [*torch_model.named_parameters(), *torch_model.named_buffers()]
    if sum(t.numel() for _, t in tensors) > TRACE_CACHE_MAX_PARAMS:
        return None
    h = hashlib.sha256()
    h.update(f"{type(torch_model).__module__}.{type(torch_model).__qualname__}".encode())
    config = torch_model.config
    to_dict = getattr(config, "to_dict", None)
    if to_dict is None:
        h.update(repr(config).encode())
    else:  # where the config was read from is no part of the graph: each xdist worker and
        # each test's tmp_path keeps its own copy of the same tiny model
        fields = {k: v for k, v in to_dict().items() if k != "_name_or_path"}
        h.update(json.dumps(fields, sort_keys=True, default=repr).encode())
    if checkpoint is not None:
        files = sorted({info.file for info in checkpoint.tensors.values()})
        for path in files:
            h.update(f"{path.name} {source_digest(path)}".encode())
        tensors = list(torch_model.named_buffers())  # parameters: read from the checkpoint
    for name, tensor in tensors:
        if tensor.device.type == "meta":
            return None
        h.update(f"{name} {tensor.dtype} {tuple(tensor.shape)}".encode())
        data = tensor.detach().contiguous()
        if data.dtype == torch.bfloat16:
            data = data.view(torch.int16)
        h.update(data.numpy().tobytes())
    return h.hexdigest()


def _build_once(key_text: str, build: Any, source: str) -> Path:
    """The folder holding ``art`` built by ``build(path)`` for ``key_text``, once per run."""
    assert _ROOT is not None
    key = hashlib.sha256(key_text.encode()).hexdigest()[:20]
    built = _ROOT / key
    _ROOT.mkdir(parents=True, exist_ok=True)
    with FileLock(str(_ROOT / f"{key}.lock")):
        if not built.is_dir():
            partial = _ROOT / f"{key}.building"
            shutil.rmtree(partial, ignore_errors=True)
            t0 = time.perf_counter()
            build(partial / "art")
            (partial / "source.txt").write_text(source)
            partial.rename(built)
            test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]
            with (_ROOT / BUILDS).open("a") as log:  # for the run's summary: who paid what
                kind = "trace" if key_text.startswith("trace ") else "export"
                log.write(f"{time.perf_counter() - t0:.1f}\t{kind}\t{source}\t{test}\n")
    return built


def _retarget_source(out: Path, built_from: str, src: Path) -> None:
    manifest_file = out / "specport.json"
    data = json.loads(manifest_file.read_text())
    source = data.get("source")
    if isinstance(source, dict) and source.get("path") == built_from and built_from != str(src):
        source["path"] = str(src)
        manifest_file.write_text(json.dumps(data, indent=2) + "\n")
