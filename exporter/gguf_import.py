"""Import a GGUF file (llama.cpp's format) as a Hugging Face model directory.

Like the llama2c import, the GGUF file is turned into a regular Hugging Face directory
(config.json, model.safetensors, tokenizer files, generation_config.json) so it takes exactly
the same export, verification and runtime path as any other source. The tokenizer is rebuilt by
transformers' own GGUF tokenizer converter, so the artifact tokenizes exactly like
`AutoTokenizer.from_pretrained(dir, gguf_file=...)`; the chat template from the file's metadata
is written into tokenizer_config.json.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

from specport.core.errors import InvalidModelError
from specport.exporter import gguf_config, gguf_tensors
from specport.exporter.registry import lookup

logger = logging.getLogger(__name__)


def open_gguf(path: Path) -> Any:
    """A memory-mapped `gguf.GGUFReader`, or an error saying how to get `gguf` / a valid file."""
    try:
        from gguf import GGUFReader
    except ImportError as e:
        raise InvalidModelError(
            f"{path} is a GGUF file; reading it needs the `gguf` package: "
            "pip install 'specport[gguf]' (or pip install gguf)."
        ) from e
    try:
        return GGUFReader(str(path), "r")
    except Exception as e:  # noqa: BLE001 - the reader raises ValueError/struct errors/...
        raise InvalidModelError(
            f"{path} is not a readable GGUF file ({type(e).__name__}: {e}). The file is "
            "truncated or corrupt; re-download it."
        ) from e


def file_sha256(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def save_gguf_as_hf(path: Path, out_dir: Path, progress: bool | None = None) -> dict[str, Any]:
    """Write the Hugging Face directory for GGUF file `path` into `out_dir`.

    Returns the manifest's `gguf` report: architecture, file sha256, tensor types and what was
    kept exactly versus converted.
    """

    path = Path(path)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    reader = open_gguf(path)
    meta = gguf_config.Metadata(reader, str(path))
    model_type = gguf_config.model_type(meta)
    lookup(model_type)  # an unsupported family fails here, before any weight is read
    tensors = {t.name: t for t in reader.tensors}
    small = _rope_tensors(tensors)
    cfg = gguf_config.hf_config(meta, tensors, small)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    names = gguf_tensors.hf_parameter_names(out_dir)
    plan = gguf_tensors.plan(meta.arch, model_type, cfg, tensors, names)
    logger.info(
        "GGUF %s: %s, %d layers, %d tensors -> %s",
        path.name,
        meta.arch,
        cfg["num_hidden_layers"],
        len(tensors),
        model_type,
    )
    report = gguf_tensors.write_safetensors(
        tensors, plan, out_dir / "model.safetensors", progress=progress
    )
    gen = {
        k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if cfg[k] is not None
    }
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    tokenizer = write_tokenizer(path, out_dir, cfg["max_position_embeddings"])
    tokenizer["model"] = str(meta.get("tokenizer.ggml.model", ""))
    del reader, tensors
    return {
        "architecture": meta.arch,
        "model_type": model_type,
        "sha256": file_sha256(path),
        "bytes": path.stat().st_size,
        "tensor_types": report["tensor_types"],
        "kept_exactly": _kept(report["conversion"]),
        "converted": _converted(report["conversion"], plan.arch),
        "tokenizer": tokenizer,
    }


def tensor_plan(path: Path) -> tuple[Any, gguf_tensors.Plan]:
    """(reader, plan) of a GGUF file without converting any weight: which GGUF tensor is which
    Hugging Face parameter (for passes that read the file's own blocks)."""
    import tempfile

    reader = open_gguf(Path(path))
    meta = gguf_config.Metadata(reader, str(path))
    model_type = gguf_config.model_type(meta)
    tensors = {t.name: t for t in reader.tensors}
    cfg = gguf_config.hf_config(meta, tensors, _rope_tensors(tensors))
    with tempfile.TemporaryDirectory(prefix="specport-gguf-plan-") as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(cfg))
        names = gguf_tensors.hf_parameter_names(Path(tmp))
    return reader, gguf_tensors.plan(meta.arch, model_type, cfg, tensors, names)


def _rope_tensors(tensors: dict[str, Any]) -> dict[str, np.ndarray]:
    from gguf import dequantize

    return {
        n: np.asarray(dequantize(tensors[n].data, tensors[n].tensor_type), dtype=np.float32)
        for n in gguf_tensors.ROPE_TENSORS
        if n in tensors
    }


def _kept(conversion: dict[str, dict[str, int]]) -> list[str]:
    """Tensor types whose values reach the ONNX weights unchanged (float types copied as is)."""
    return sorted(t for t, how in conversion.items() if set(how) == {"kept"})


def _converted(conversion: dict[str, dict[str, int]], arch: str) -> dict[str, str]:
    notes = {}
    for qtype, how in conversion.items():
        if "dequantized" in how:
            notes[qtype] = (
                "dequantized to float32 with gguf's reference dequantizer (every weight value "
                "the file encodes, exactly; 32-bit storage)"
            )
        if "norm_minus_one" in how:
            notes[f"{qtype} norm weights"] = (
                "stored as 1 + w by llama.cpp; w = value - 1 in float32"
            )
    if arch in gguf_config.PERMUTED_QK:
        notes["q/k rows"] = (
            "llama.cpp's interleaved rotary row order undone (a permutation, lossless)"
        )
    return notes


def write_tokenizer(path: Path, out_dir: Path, context: int) -> dict[str, Any]:
    """tokenizer.json + tokenizer_config.json (with the chat template) from the GGUF metadata."""
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(
            str(path.parent), gguf_file=path.name, local_files_only=True
        )
    except Exception as e:  # noqa: BLE001 - a missing tokenizer is not fatal for export
        logger.warning(
            "could not rebuild the tokenizer of %s (%s): the artifact will need --prompt-ids",
            path,
            e,
        )
        return {"kind": "none"}
    tok.model_max_length = context
    for key in ("local_files_only", "is_local"):
        tok.init_kwargs.pop(key, None)
    # The template inside tokenizer_config.json: the place every tool (and older transformers) reads.
    tok.save_pretrained(str(out_dir), save_jinja_files=False)
    return {"chat_template": bool(getattr(tok, "chat_template", None))}
