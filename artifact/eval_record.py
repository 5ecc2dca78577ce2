"""Record a perplexity evaluation in an artifact's manifest and model card (`eval ... --record`).

Why opt-in: evaluation is read-only everywhere users come from (llama.cpp's `llama-perplexity`,
Optimum / lm-eval): an artifact may sit in a shared cache or be published with its hashes, so
`specport eval` changes nothing unless asked. With `--record` only `specport.json` and the
generated model card change; the card's new sha256 is written into the manifest, so
`read_manifest` still verifies every file. The artifact's hashes are checked *before* recording,
so a tampered artifact is never re-blessed.

The record (manifest key `eval`) names the text (file name + sha256) and the options that
define the token set (max_docs, last, context, chunk); a reference perplexity of the float32
source is attached when it was measured on the same text and options: by `eval compare
SOURCE THIS --record` (same run), or carried from the source's own recorded `eval` by
`specport quantize` (manifest key `source_eval`).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from specport.artifact.manifest import (
    MANIFEST_NAME,
    Manifest,
    read_manifest,
    sha256_file,
    write_text_atomic,
)
from specport.core.errors import ArtifactError, UsageError

logger = logging.getLogger(__name__)

EVAL_KEY = "eval"
SOURCE_EVAL_KEY = "source_eval"


def text_identity(text_file: str | os.PathLike[str]) -> dict[str, str]:
    p = Path(text_file)
    return {"text": p.name, "text_sha256": sha256_file(p)}


def options_key(max_docs: int | None, last: bool, context: int | None, chunk: int | None):
    """The evaluation options that decide which tokens are scored (part of the match key)."""
    return {"max_docs": max_docs, "last": bool(last), "context": context, "chunk": chunk}


def _same_tokens(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.get("text_sha256") == b.get("text_sha256") and a.get("options") == b.get("options")


def _label(manifest: Manifest) -> str:
    quant = manifest.quant or {}
    scheme = quant.get("scheme")
    return str(scheme) if scheme not in (None, "none") else manifest.dtype


def artifact_label(path: str | os.PathLike[str]) -> str:
    """ "float32", "w4a16", ... of an artifact; "reference" for a bare .onnx file."""
    try:
        return _label(read_manifest(path, check_hashes=False))
    except ArtifactError:
        return "reference"


def _is_quantized(manifest: Manifest) -> bool:
    """Quantized weights or an int8 KV cache: a float32 reference makes sense."""
    scheme = (manifest.quant or {}).get("scheme")
    return scheme not in (None, "none") or manifest.kv.dtype != "float32"


def require_artifact_dir(path: str | os.PathLike[str]) -> Path:
    d = Path(path)
    if not (d.is_dir() and (d / MANIFEST_NAME).exists()):
        raise UsageError(
            f"--record writes into an artifact's {MANIFEST_NAME}; {d} is not an artifact "
            "directory. Drop --record, or pass the directory."
        )
    return d


def record_eval(
    artifact: str | os.PathLike[str],
    result: dict[str, Any],
    text_file: str | os.PathLike[str],
    options: dict[str, Any],
    reference: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write `result` ({ppl, nll?, tokens, docs}) as the artifact's `eval` record; return it.

    `reference`: {ppl, label, via} of the float32 source on the same tokens, when known; else
    a matching `source_eval` (from quantize) or a previous record's reference is reused.
    """
    d = require_artifact_dir(artifact)
    manifest = read_manifest(d)  # verifies every hash first
    record: dict[str, Any] = {
        **text_identity(text_file),
        "options": options,
        "ppl": float(result["ppl"]),
        "tokens": int(result["tokens"]),
        "docs": int(result["docs"]),
        "of": _label(manifest),
    }
    if reference is None and _is_quantized(manifest):
        reference = _known_reference(manifest, record)
    if reference is not None:
        record["reference"] = reference
        record["ppl_delta"] = record["ppl"] - float(reference["ppl"])
        record["ppl_delta_rel"] = record["ppl_delta"] / float(reference["ppl"])
    manifest.extra[EVAL_KEY] = record
    _write(d, manifest)
    logger.info("recorded perplexity %.4f on %s in %s", record["ppl"], record["text"], d)
    return record


def _known_reference(manifest: Manifest, record: dict[str, Any]) -> dict[str, Any] | None:
    src = manifest.extra.get(SOURCE_EVAL_KEY)
    if isinstance(src, dict) and _same_tokens(src, record) and src.get("ppl") is not None:
        return {"ppl": float(src["ppl"]), "label": src.get("of", "float32"), "via": "quantize"}
    old = manifest.extra.get(EVAL_KEY)
    if isinstance(old, dict) and _same_tokens(old, record) and old.get("reference"):
        return dict(old["reference"])
    return None


def source_eval_for_quantized(source: Manifest) -> dict[str, Any] | None:
    """What `quantize` carries over from its source: the source's own record (float32 only)."""
    ev = source.extra.get(EVAL_KEY)
    if isinstance(ev, dict) and ev.get("ppl") is not None and not _is_quantized(source):
        return {
            k: ev[k] for k in ("text", "text_sha256", "options", "ppl", "tokens", "of") if k in ev
        }
    return None


def _write(d: Path, manifest: Manifest) -> None:
    """Regenerate the card (if specport generated one) and write the manifest, each atomically."""
    from specport.artifact.files import refresh_card

    try:
        card = refresh_card(d, manifest)
        if card is not None:
            name, text = card
            write_text_atomic(d / name, text)
            manifest.files[name] = sha256_file(d / name)
        write_text_atomic(d / MANIFEST_NAME, json.dumps(manifest.to_json(), indent=2) + "\n")
    except OSError as e:
        raise ArtifactError(f"could not record the evaluation in {d}: {e}") from e
