"""The API's build steps (export, quantize, optimize, train MTP heads), each preflighted.

Each one first runs its `specport.preflight` checks (a second, no weights loaded) and only
then starts the long work, which the CLI and the API share. `specport.api` re-exports them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from specport import preflight
from specport.artifact import manifest as art
from specport.core import history
from specport.core.onnx_file import load_onnx_input, load_repaired_ir, save_onnx_atomic
from specport.core.onnx_parity import check_parity
from specport.core.progress import Stages
from specport.loading import load
from specport.passes.io_contract import fused_io_contract
from specport.passes.quant.apply import quantize_artifact
from specport.passes.quant.inline import INLINE_SCHEMES


def export(
    model: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    quant: str | None = None,
    **kwargs: Any,
) -> art.Manifest:
    """Export a source model to an artifact directory; see `specport.exporter.export.export_model`
    for the keyword arguments. `quant` ("w8a8" | "w8a16" | "w4a16" | "w4a8") quantizes the
    artifact in place afterwards (default recipe, no calibration text)."""
    names = ("tokenizer", "target", "fuse", "passes", "layers", "kv_layout", "max_length", "dtype")
    checked = {k: kwargs[k] for k in (*names, "tree_mask") if k in kwargs}
    preflight.check_export(model, out, quant=quant, **checked)
    from specport.exporter.export import export_model

    defaults = history.defaults_of(export_model)
    with history.operation("export", model, defaults, out=out, quant=quant, **kwargs):
        if quant in INLINE_SCHEMES:  # quantized while the weights stream: no float model held
            return export_model(model, out, quant=quant, **kwargs)
        kwargs.pop("quant_algo", None)
        manifest = export_model(model, out, **kwargs)
        if quant is not None:  # part of this export: one history entry
            manifest = quantize_artifact(out, out, scheme=quant)
        return manifest


def quantize(
    src: str | os.PathLike[str], out: str | os.PathLike[str], **kwargs: Any
) -> art.Manifest:
    """Quantize an artifact into a new one; see `specport.passes.quant.apply.quantize_artifact`.
    `out` must differ from `src` (the source artifact is never replaced)."""

    if not callable(kwargs.get("progress")):
        kwargs.pop("progress", None)  # a bool asks for the default display, which is stderr
    preflight.check_quantize(src, out, **kwargs)
    defaults = history.defaults_of(quantize_artifact)
    defaults.pop("scheme", None)  # always recorded: the one thing a reader looks for
    with history.operation("quantize", src, defaults, out=out, **kwargs):
        return quantize_artifact(src, out, **kwargs)


def optimize(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    target: str = "cpu",
    passes: list[str] | None = None,
    **options: Any,
) -> tuple[Path, dict[str, Any]]:
    """Fuse and lower any ONNX decoder graph `src` for `target`; write `out` (+ `out.data`).

    Returns (out path, report; `report["io_contract"]` describes the graph's KV inputs,
    `report["repairs"]` what was repaired on load, `report["parity"]` the numeric check). The
    input is accepted as onnxruntime accepts it (see `specport.core.onnx_file`); the output is run
    against the input on random inputs (`specport.core.onnx_parity`) before it is renamed into
    place, and `out` must be new or an earlier `optimize` output, never one of the input's
    files.
    """
    from specport.passes.pipelines import optimize_model

    preflight.check_optimize(src, out, target, passes, options)

    proto, repairs = load_onnx_input(src)
    opts = {"target": target, "passes": passes, **options}
    past = history.onnx_history({p.key: p.value for p in proto.metadata_props})
    entry = history.make_entry("optimize", {"out": out, **opts}, src, {"target": "cpu"})
    stages = Stages(total=2)
    stages.start("rewriting the graph")
    model, report = optimize_model(load_repaired_ir(src, proto), target, passes, **options)
    report["io_contract"] = fused_io_contract(model)
    report["repairs"] = repairs
    model.metadata_props[history.ONNX_KEY] = json.dumps([*past, entry])
    stages.start("writing the output and checking it against onnxruntime on the input")

    def check(written: Path) -> None:
        report["parity"] = check_parity(Path(src), written, proto)

    path = save_onnx_atomic(model, Path(out), mark=target, check=check)
    stages.done()
    return path, report


def train_mtp(
    artifact: str | os.PathLike[str], out: str | os.PathLike[str], **kwargs: Any
) -> art.Manifest:
    """Train MTP draft heads for `artifact` into a new artifact `out`; see
    `specport.train.mtp_train.train_mtp` for the keyword arguments."""
    checked = {k: kwargs[k] for k in ("num_heads", "data", "steps", "num_sequences") if k in kwargs}
    preflight.check_train_mtp(artifact, out, **checked)
    from specport.train.mtp_train import train_mtp as _train

    defaults = history.defaults_of(_train)
    with history.operation("train-mtp", artifact, defaults, out=out, **kwargs):
        return _train(artifact, out, load_model=load, **kwargs)
