"""`--draft self`: the target's own 4-bit file as its draft model, made once and cached.

A model drafts best for itself: SmolLM2-135M's own 4-bit file has 0.97 of its drafts right,
where an EAGLE head trained for 30 minutes has 0.4-0.6. Quantized from the same artifact, the
draft's layers are the target's, so it drafts in the target's own KV cache and never reads
the prompt (runtime/speculative/draft.py, `first_layers_of`). A user had to know the recipe
and keep the file; `draft="self"` makes it on first use from the target's float weights, with
the recipe that drafted best (W4A8, round-to-nearest, float zero points: on SmolLM2's Q4_1
grid the body is the target's exactly; docs/benchmarks/2026-12-07-draft-in-target-kv.md), and
keeps it under the cache folder, keyed by the target's weights and the recipe, so the next
run starts at once. The target's folder is never written to.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from specport.artifact.manifest import MANIFEST_NAME, Manifest
from specport.core.errors import InputError, OutputError
from specport.core.options import option
from specport.core.settings import cache_dir

logger = logging.getLogger(__name__)

SELF = "self"  # the `draft` value that asks for it
RECIPE: dict[str, Any] = {"scheme": "w4a8", "algo": "rtn", "float_zero": True}
RECIPE_VERSION = 1  # bump when RECIPE or what quantize makes of it changes


def is_self(draft: object) -> bool:
    """Whether `draft` asks for the target's own draft (the literal "self"; a folder of that
    name is reached as ./self)."""
    return isinstance(draft, str) and draft == SELF


def self_draft_dir(target: Path, manifest: Manifest) -> Path:
    """Where the self draft of `target` lives: the cache's drafts folder, named after the
    target's folder and keyed by its files' hashes (an artifact whose manifest lists none:
    its path and its files' sizes and times) and the recipe."""
    files: Any = sorted((manifest.files or {}).items())
    if not files:
        files = [str(target.resolve())] + [
            [f.name, f.stat().st_size, f.stat().st_mtime_ns]
            for f in sorted(target.iterdir())
            if f.is_file()
        ]
    key = json.dumps(
        {"files": files, "recipe": RECIPE, "version": RECIPE_VERSION},
        sort_keys=True,
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_dir() / "drafts" / f"{target.resolve().name}-{digest}"


def check_self_draft(manifest: Manifest) -> None:
    """Refuse a target a self draft cannot be made from, before any work: quantize needs its
    float weights, and only the shared KV layout lets the draft read the target's cache."""
    scheme = (manifest.quant or {}).get("scheme")
    if scheme and scheme != "none":
        raise InputError(
            f"{option('draft', SELF)} quantizes the target into its draft, but this artifact "
            f"is already {scheme}: pass a draft made from its float source instead "
            "(`specport quantize FLOAT --scheme w4a8 --algo rtn --float-zero --out DRAFT`)"
        )
    if manifest.kv.layout != "shared":
        raise InputError(
            f"{option('draft', SELF)} drafts in the target's KV cache, which needs the shared "
            f"layout; this artifact's is {manifest.kv.layout!r} (re-export with "
            "`--kv-layout shared`, or pass a draft artifact)"
        )


def ensure_self_draft(target: Path, manifest: Manifest) -> Path:
    """The self draft's folder, made now if the cache does not hold it yet (SmolLM2-135M on 2
    cores: 13.7 s, its first answer included; progress on stderr). Built beside its final place and renamed
    into it, so an interrupted build leaves nothing that looks finished."""
    check_self_draft(manifest)
    final = self_draft_dir(target, manifest)
    if (final / MANIFEST_NAME).is_file():
        return final
    from specport import preflight
    from specport.core import history
    from specport.core.progress import stage_callback
    from specport.passes.quant.apply import quantize_artifact

    try:
        final.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(
            f"{option('draft', SELF)} keeps its draft under {final.parent}, which cannot be "
            f"made ({exc.strerror}); set SPECPORT_CACHE to a writable folder"
        ) from exc
    building = final.with_name(f".{final.name}.building-{os.getpid()}")
    shutil.rmtree(building, ignore_errors=True)
    logger.warning("making the self draft once (%s), kept in %s", RECIPE, final)
    try:
        preflight.check_quantize(target, building, **RECIPE)
        with history.operation("quantize", target, {}, out=final, **RECIPE):
            quantize_artifact(target, building, progress=stage_callback(), **RECIPE)
        try:
            os.replace(building, final)
        except OSError:  # another process finished first: use its draft
            if not (final / MANIFEST_NAME).is_file():
                raise
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return final
