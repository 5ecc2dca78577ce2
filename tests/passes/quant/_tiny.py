"""Helpers for the quantization and eval tests: give a tiny exported artifact a tokenizer.

The tiny zoo artifacts (tests/fixtures.py) have random weights and no tokenizer; calibration
and perplexity need `tokenizer.json`, so we add a character-level WordLevel tokenizer whose
ids fit the tiny vocabulary (256) and re-hash the manifest.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

from tokenizers import Regex, Tokenizer, models, pre_tokenizers

from specport.artifact.files import write_artifact_manifest
from specport.artifact.manifest import read_manifest

WORDS = [
    "once",
    "upon",
    "a",
    "time",
    "there",
    "was",
    "a",
    "little",
    "girl",
    "named",
    "lily",
    "she",
    "liked",
    "to",
    "play",
    "with",
    "her",
    "ball",
    "in",
    "the",
    "park",
]


def char_tokenizer() -> Tokenizer:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for c in range(32, 127):
        vocab[chr(c)] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return tok


def with_tokenizer(src: Path, dst: Path) -> Path:
    """Copy artifact `src` to `dst` and add tokenizer.json (manifest files re-hashed)."""
    shutil.copytree(src, dst)
    char_tokenizer().save(str(dst / "tokenizer.json"))
    m = read_manifest(dst)
    m.config.setdefault("bos_token_id", 1)
    write_artifact_manifest(dst, m)
    return dst


def write_corpus(path: Path, docs: int = 24, seed: int = 0) -> Path:
    """Blank-line separated pseudo-stories, 10-30 words each."""
    rng = random.Random(seed)
    stories = [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 30))) + "." for _ in range(docs)
    ]
    path.write_text("\n\n".join(stories) + "\n")
    return path
