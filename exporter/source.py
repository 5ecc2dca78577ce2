"""Find and load the source model: a Hugging Face directory, a cached hub id, a llama2c .bin or a
GGUF file.

Every failure here is the user's input, so each raises an error that names the file and the fix.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specport.core.errors import InvalidModelError, ModelNotFoundError
from specport.core.progress import bar_enabled
from specport.exporter.archs.base import ArchConfig
from specport.exporter.config_check import check_config_against_weights
from specport.exporter.gguf_import import save_gguf_as_hf
from specport.exporter.registry import lookup

logger = logging.getLogger(__name__)


@dataclass
class Source:
    """A resolved source model: where it is, what kind, and its (unloaded) config."""

    kind: str  # "hf" | "hub" | "llama2c" | "gguf"
    path: Path  # a Hugging Face model directory (llama2c and GGUF are converted to one first)
    original: str  # what the user passed
    config: Any
    arch: type[ArchConfig]
    keep_alive: list[Any] = field(default_factory=list)  # temp dirs that must outlive export
    details: dict[str, Any] = field(default_factory=dict)  # kind-specific manifest facts

    def describe(self) -> dict[str, Any]:
        described = {
            "kind": self.kind,
            # absolute for local files: tools that find the source again (bench peers, MTP
            # training) must not depend on the directory the export ran from
            "path": self.original if self.kind == "hub" else str(Path(self.original).resolve()),
            "config_sha256": _config_hash(self.path),
        }
        return described | self.details


def _config_hash(path: Path) -> str:
    import hashlib

    cfg = path / "config.json"
    return hashlib.sha256(cfg.read_bytes()).hexdigest() if cfg.exists() else ""


def resolve(
    model: str | os.PathLike[str],
    tokenizer: str | os.PathLike[str] | None = None,
    progress: bool | None = None,
) -> Source:
    """Turn what the user typed into a `Source`, or raise with a message that says what to do."""
    text = str(model)
    p = Path(text).expanduser()
    if p.is_file() and p.suffix == ".bin":
        return _from_llama2c(p, Path(tokenizer) if tokenizer else None)
    if p.is_file() and (p.suffix.lower() == ".gguf" or _is_gguf(p)):
        return _from_gguf(p, progress)
    if p.is_dir():
        return _from_dir(p, kind="hf", original=text)
    if p.exists():
        raise ModelNotFoundError(
            f"{p} is a file, not a model. Pass a Hugging Face model directory (with config.json), "
            "a GGUF file (.gguf) or a llama2c checkpoint (.bin, with --tokenizer tokenizer.bin)."
        )
    looks_like_path = (
        text.startswith((".", "/", "~")) or text.endswith((".bin", ".json")) or os.sep * 2 in text
    )
    if not looks_like_path and text.count("/") <= 1:
        cached = _from_hub_cache(text)
        if cached is not None:
            return _from_dir(cached, kind="hub", original=text)
        raise ModelNotFoundError(
            f"model {text!r} is neither a local directory nor in the local Hugging Face cache, and "
            "specport does not download. Download it first (e.g. `huggingface-cli download "
            f"{text}`) on a machine with network, or pass the path of a local model directory."
        )
    raise ModelNotFoundError(
        f"model path not found: {p}. Check the path (it must be a directory with config.json or a llama2c .bin)."
    )


def _from_hub_cache(repo_id: str) -> Path | None:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # noqa: BLE001 - any failure means "not cached"
        return None


def read_config(path: Path) -> tuple[Any, type[ArchConfig]]:
    cfg_path = path / "config.json"
    if not cfg_path.exists():
        raise ModelNotFoundError(
            f"{path} has no config.json; it is not a Hugging Face model directory. "
            "Pass the directory written by `save_pretrained`, or a llama2c .bin file."
        )
    try:
        raw = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidModelError(
            f"{cfg_path} is not valid JSON ({e}). Repair or re-download the model's config.json."
        ) from e
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise InvalidModelError(
            f"{cfg_path} has no 'model_type'; it is not a transformers config. Re-download the model."
        )
    arch = lookup(raw["model_type"])
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True), arch
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds here
        raise InvalidModelError(
            f"could not read {cfg_path}: {e}. Repair or re-download the model's config.json."
        ) from e


def _from_dir(path: Path, kind: str, original: str) -> Source:
    config, arch = read_config(path)
    check_config_against_weights(path, config, arch.layers_attr, dict(arch.load_kwargs))
    return Source(kind=kind, path=path, original=original, config=config, arch=arch)


def _from_llama2c(checkpoint: Path, tokenizer: Path | None) -> Source:
    from specport.exporter.llama2c import find_llama2c_tokenizer, save_llama2c_as_hf

    if tokenizer is None:
        tokenizer = find_llama2c_tokenizer(checkpoint)
        if tokenizer is None:
            logger.warning(
                "no --tokenizer given and no tokenizer .bin beside %s; the artifact will need --prompt-ids",
                checkpoint,
            )
    tmp = tempfile.TemporaryDirectory(prefix="specport-llama2c-")
    hf_dir = save_llama2c_as_hf(checkpoint, tokenizer, Path(tmp.name))
    config, arch = read_config(hf_dir)
    src = Source(kind="llama2c", path=hf_dir, original=str(checkpoint), config=config, arch=arch)
    src.keep_alive.append(tmp)
    return src


def _is_gguf(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4) == b"GGUF"


def _from_gguf(path: Path, progress: bool | None) -> Source:
    tmp = tempfile.TemporaryDirectory(prefix="specport-gguf-")
    try:
        details = save_gguf_as_hf(path, Path(tmp.name), progress=progress)
        config, arch = read_config(Path(tmp.name))
    except BaseException:
        tmp.cleanup()
        raise
    src = Source(
        kind="gguf",
        path=Path(tmp.name),
        original=str(path),
        config=config,
        arch=arch,
        details={"gguf": details},
    )
    src.keep_alive.append(tmp)
    return src


def load_model(source: Source, num_layers: int | None = None, progress: bool = False) -> Any:
    """Load the PyTorch model in float32, eval mode; truncated or corrupt weights -> clear error.

    `num_layers` keeps only the first N decoder layers (a self-draft model for speculation).
    """
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    if bar_enabled(progress):  # transformers' own weight-loading bar: terminals only
        transformers.utils.logging.enable_progress_bar()
    else:
        transformers.utils.logging.disable_progress_bar()
    if not logger.isEnabledFor(logging.INFO):
        # transformers logs a load report listing checkpoint keys the class does not use
        # (e.g. DeepSeek-V3's MTP layers, which we keep separately): not the user's concern.
        transformers.utils.logging.set_verbosity_error()
    kwargs = dict(source.arch.load_kwargs)
    if num_layers is not None:
        total = int(getattr(source.config, source.arch.layers_attr))
        if not 1 <= num_layers <= total:
            raise InvalidModelError(
                f"--layers {num_layers} is out of range: the model has {total} layers (use 1..{total})."
            )
        kwargs[source.arch.layers_attr] = num_layers
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(source.path), dtype=torch.float32, local_files_only=True, **kwargs
        )
    except OSError as e:
        raise InvalidModelError(
            f"could not load weights from {source.path}: {e}. The weight files are missing, "
            "truncated or corrupt; re-download the model."
        ) from e
    except Exception as e:  # noqa: BLE001 - safetensors/torch raise assorted types
        raise InvalidModelError(
            f"could not load weights from {source.path} ({type(e).__name__}: {e}). "
            "The weight files are probably truncated or corrupt; re-download the model."
        ) from e
    model.eval()
    return model
