"""Reading a suffix-drafting corpus: earlier answers, as JSON lines of ids or text.

`specport generate|serve|bench --speculative suffix --suffix-corpus FILE` seeds the model's
`SuffixIndex` with earlier outputs before the first request. One JSON object per line, with
``"ids"`` (token ids of the model's vocabulary) or ``"text"`` (tokenized here, without special
tokens): chat logs, earlier completions, or the model's own answers to typical prompts
(`python -m specport.samples.suffix_corpus`).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from specport.core.errors import InputError

logger = logging.getLogger(__name__)


def read_corpus(
    path: str | os.PathLike[str], tokenizer: Any | None, vocab_size: int
) -> list[list[int]]:
    """The corpus file's sequences as token ids, or an error naming the bad line."""
    source = Path(path)
    if not source.is_file():
        raise InputError(f"--suffix-corpus {source}: no such file.")
    sequences: list[list[int]] = []
    try:
        with source.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, 1):
                if line.strip():
                    sequences.append(_sequence(line, tokenizer, vocab_size, f"{source}:{number}"))
    except UnicodeDecodeError:
        raise InputError(f"--suffix-corpus {source} is not UTF-8 text (JSON lines).") from None
    if not sequences:
        raise InputError(f"--suffix-corpus {source} has no sequences (one JSON object per line).")
    logger.info(
        "suffix corpus %s: %d sequences, %d tokens",
        source,
        len(sequences),
        sum(len(s) for s in sequences),
    )
    return sequences


def parse_line(line: str, where: str) -> list[int] | str:
    """One corpus line: its token ids, or its text (tokenized by the caller that has the
    model); an error naming the line (`where`) otherwise. No model needed, so a file can be
    checked before anything loads (`suffix_record.check_record`)."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise InputError(f"{where}: not a JSON object ({err.msg}).") from None
    if isinstance(record, dict) and isinstance(record.get("ids"), list):
        ids = record["ids"]
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise InputError(f"{where}: ids must be non-negative token ids.")
        return [int(t) for t in ids]
    if isinstance(record, dict) and isinstance(record.get("text"), str):
        return str(record["text"])
    raise InputError(f'{where}: each line needs "ids" (a list of token ids) or "text".')


def _sequence(line: str, tokenizer: Any | None, vocab_size: int, where: str) -> list[int]:
    parsed = parse_line(line, where)
    if isinstance(parsed, list):
        if any(t >= vocab_size for t in parsed):
            raise InputError(f"{where}: ids must be token ids in 0..{vocab_size - 1}.")
        return parsed
    if tokenizer is None:
        raise InputError(f"{where}: a text line needs the artifact's tokenizer; give ids.")
    return [int(t) for t in tokenizer.encode(parsed, add_special_tokens=False).ids]


def write_corpus(path: str | Path, sequences: list[list[int]], texts: list[str]) -> None:
    """Write sequences (with their text, for people reading the file) as JSON lines."""
    with Path(path).open("x", encoding="utf-8") as out:  # never overwrite a user's file
        for ids, text in zip(sequences, texts):
            out.write(json.dumps({"ids": ids, "text": text}) + "\n")
