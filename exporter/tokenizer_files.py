"""Copy (or create) the tokenizer files an artifact ships with.

The runtime reads `tokenizer.json` with the `tokenizers` library, so a source that only has
slow-tokenizer files (vocab.json + merges.txt, tokenizer.model) is converted once at export.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "generation_config.json",
    "chat_template.jinja",
)


def copy_tokenizer(source_dir: Path, out_dir: Path) -> dict[str, Any]:
    """Copy tokenizer files into the artifact; returns the manifest's `tokenizer` section."""
    copied = []
    for name in TOKENIZER_FILES:
        src = source_dir / name
        if src.exists():
            shutil.copy2(src, out_dir / name)
            copied.append(name)
    if "tokenizer.json" not in copied and _has_slow_files(source_dir):
        try:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(source_dir), local_files_only=True)
            tok.save_pretrained(str(out_dir / ".tok"))
            for p in (out_dir / ".tok").iterdir():
                if p.name in TOKENIZER_FILES and not (out_dir / p.name).exists():
                    shutil.move(str(p), out_dir / p.name)
                    copied.append(p.name)
            shutil.rmtree(out_dir / ".tok", ignore_errors=True)
        except Exception as e:  # noqa: BLE001 - a missing tokenizer is not fatal for export
            logger.warning("could not convert the tokenizer in %s: %s", source_dir, e)
    if "tokenizer.json" not in copied:
        logger.warning("no tokenizer in %s: generate will need --prompt-ids", source_dir)
        return {"kind": "none", "files": sorted(copied)}
    return {"kind": "hf-tokenizers", "file": "tokenizer.json", "files": sorted(set(copied))}


def _has_slow_files(d: Path) -> bool:
    return (d / "vocab.json").exists() or (d / "tokenizer.model").exists()
