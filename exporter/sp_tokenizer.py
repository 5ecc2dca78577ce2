"""SentencePiece-style BPE tokenizers built with Hugging Face `tokenizers`, without sentencepiece.

Llama-family checkpoints that do not come from the hub (llama2.c's `tokenizer.bin`, the demo
model trained here) still need a `tokenizer.json` that behaves exactly like the one Hugging Face
derives from a SentencePiece BPE model: `▁` marks a space, a space is prepended to the text,
unknown characters fall back to `<0xNN>` byte tokens, and the merges are derived from the vocab
ordered by piece score. Building that here keeps the runtime on one tokenizer code path for every
model and lets us import llama2.c tokenizers with no extra dependency.
"""

from __future__ import annotations

import json
import logging
import re
import struct
from collections.abc import Sequence
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from specport.core.errors import InvalidModelError, ModelNotFoundError

logger = logging.getLogger(__name__)

SPACE = "▁"
UNK, BOS, EOS = "<unk>", "<s>", "</s>"
_BYTE_PIECE = re.compile(r"^<0x[0-9A-F]{2}>$")


def byte_pieces() -> list[str]:
    """The 256 byte-fallback pieces `<0x00>`..`<0xFF>`, in SentencePiece's order."""
    return [f"<0x{i:02X}>" for i in range(256)]


def read_llama2c_tokenizer(path: Path) -> list[tuple[str, float]]:
    """Read llama2.c's `tokenizer.bin` into SentencePiece pieces with their scores.

    Format: int32 max_token_length, then per token float32 score, int32 byte length, UTF-8 bytes.
    llama2.c's exporter wrote `▁` as a plain space and BOS/EOS as `\\n<s>\\n` / `\\n</s>\\n`;
    both are undone here so the pieces are the original SentencePiece ones.
    """
    path = Path(path)
    if not path.is_file():
        raise ModelNotFoundError(
            f"llama2.c tokenizer {path} not found: pass the tok*.bin file that belongs to the checkpoint."
        )
    data = path.read_bytes()
    if len(data) < 4:
        raise InvalidModelError(f"llama2.c tokenizer {path} is truncated ({len(data)} bytes).")
    (max_len,) = struct.unpack_from("<i", data, 0)
    if not 0 < max_len < 1 << 16:
        raise InvalidModelError(
            f"llama2.c tokenizer {path} has a bad header (max_token_length={max_len}): "
            "is this a llama2.c tokenizer .bin file?"
        )
    pieces: list[tuple[str, float]] = []
    offset = 4
    while offset < len(data):
        if offset + 8 > len(data):
            raise InvalidModelError(
                f"llama2.c tokenizer {path} is truncated at token {len(pieces)}."
            )
        score, length = struct.unpack_from("<fi", data, offset)
        offset += 8
        if length < 0 or offset + length > len(data):
            raise InvalidModelError(
                f"llama2.c tokenizer {path} is truncated or corrupt at token {len(pieces)} "
                f"(length {length}); re-export it with llama2.c's tokenizer.py."
            )
        try:
            text = data[offset : offset + length].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidModelError(
                f"llama2.c tokenizer {path}: token {len(pieces)} is not valid UTF-8 ({exc})."
            ) from exc
        offset += length
        if text.startswith("\n<") and text.endswith(">\n"):
            text = text.strip("\n")
        pieces.append((text.replace(" ", SPACE), float(score)))
    if not pieces:
        raise InvalidModelError(f"llama2.c tokenizer {path} holds no tokens.")
    return pieces


def derive_merges(
    vocab: dict[str, int], ranks: dict[str, float] | None = None
) -> list[tuple[str, str]]:
    """Derive BPE merges from a SentencePiece vocab, as Hugging Face's converter does.

    Every way of splitting a piece into two in-vocab pieces is a merge; merges are ordered by the
    merged piece's rank (lower first; default its id), then by the parts' lengths, and within a
    piece by the parts' ids. Special and byte pieces never take part.
    """
    ranks = ranks if ranks is not None else {p: float(i) for p, i in vocab.items()}
    skip = {p for p in vocab if _BYTE_PIECE.match(p) or p in (UNK, BOS, EOS)}
    merges: list[tuple[str, str, float]] = []
    for piece in sorted(vocab, key=lambda p: (ranks[p], vocab[p])):
        if piece in skip:
            continue
        local = [
            (piece[:i], piece[i:], ranks[piece])
            for i in range(1, len(piece))
            if piece[:i] in vocab
            and piece[i:] in vocab
            and piece[:i] not in skip
            and piece[i:] not in skip
        ]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])))
    return [(left, right) for left, right, _ in merges]


def build_sp_bpe_tokenizer(
    pieces: Sequence[str],
    scores: Sequence[float] | None = None,
    merges: Sequence[tuple[str, str]] | None = None,
    special: Sequence[str] = (UNK, BOS, EOS),
) -> Tokenizer:
    """Build a Llama-style (SentencePiece BPE) `tokenizers.Tokenizer` from pieces.

    `pieces[i]` is the token of id i. Without `merges`, they are derived from the vocab ordered by
    score (higher first), the way SentencePiece ranks them. The result prepends `▁`, encodes
    unknown characters as `<0xNN>` bytes, adds `<s>` in front, and decodes back to the text.
    """
    vocab: dict[str, int] = {}
    for i, piece in enumerate(pieces):
        if piece in vocab:
            raise InvalidModelError(
                f"tokenizer piece {piece!r} appears twice (ids {vocab[piece]} and {i})."
            )
        vocab[piece] = i
    missing = [p for p in byte_pieces() if p not in vocab]
    if missing:
        logger.warning(
            "tokenizer lacks %d byte-fallback pieces: unknown characters map to <unk>", len(missing)
        )
    if merges is None:
        ranks = None if scores is None else {p: -float(s) for p, s in zip(pieces, scores)}
        merges = derive_merges(vocab, ranks)
    # Like Hugging Face's converter: with full byte fallback nothing is ever unknown.
    unk = UNK if missing and UNK in vocab else None
    model = models.BPE(
        vocab=vocab, merges=list(merges), unk_token=unk, fuse_unk=True, byte_fallback=True
    )
    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=SPACE, prepend_scheme="always", split=False
    )
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace(SPACE, " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens(
        [AddedToken(p, special=True, normalized=False) for p in special if p in vocab]
    )
    if BOS in vocab:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A",
            pair=f"{BOS} $A {BOS}:1 $B:1",
            special_tokens=[(BOS, vocab[BOS])],
        )
    return tok


def llama_tokenizer_config(tok: Tokenizer, model_max_length: int) -> dict:
    """`tokenizer_config.json` content that makes `AutoTokenizer` load `tok` as a Llama tokenizer."""
    vocab = tok.get_vocab()
    config: dict = {
        "tokenizer_class": "LlamaTokenizer",
        "add_bos_token": BOS in vocab,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "legacy": False,
        "model_max_length": model_max_length,
    }
    for key, piece in (("unk_token", UNK), ("bos_token", BOS), ("eos_token", EOS)):
        if piece in vocab:
            config[key] = piece
    if "<pad>" in vocab:
        config["pad_token"] = "<pad>"
    return config


def save_tokenizer(tok: Tokenizer, config: dict, out_dir: Path) -> None:
    """Write `tokenizer.json`, `tokenizer_config.json` and `special_tokens_map.json` to `out_dir`."""
    out_dir = Path(out_dir)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special = {
        k: v for k, v in config.items() if k in ("unk_token", "bos_token", "eos_token", "pad_token")
    }
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
