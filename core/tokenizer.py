"""Load an artifact's tokenizer with the `tokenizers` library (no transformers at run time)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specport.core.errors import ArtifactError, InputError


def load_tokenizer(artifact_dir: Path, info: dict[str, Any]) -> Any | None:
    if info.get("kind") != "hf-tokenizers":
        return None
    from tokenizers import Tokenizer

    path = artifact_dir / info.get("file", "tokenizer.json")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001
        raise ArtifactError(
            f"could not read the artifact's tokenizer {path}: {e}. Re-export the artifact."
        ) from e


def encode_prompt(tokenizer: Any | None, text: str) -> list[int]:
    """Token ids of `text` with the special tokens the tokenizer's post-processor adds (BOS)."""
    if tokenizer is None:
        raise InputError(
            "this artifact has no tokenizer; pass token ids with --prompt-ids 1,2,3 instead of --prompt."
        )
    if not text:
        raise InputError(
            "the prompt is empty; pass some text with --prompt (or ids with --prompt-ids)."
        )
    return list(tokenizer.encode(text, add_special_tokens=True).ids)
