"""Streaming detokenization equals one-shot decode, on SentencePiece and byte-level BPE."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from specport.runtime.detokenize import IncrementalDetokenizer

MULTIBYTE = ["héllo 日本語 🙂", "naïve café — ünïcödé ✓", "emoji 👩‍👩‍👧 family", "Ωmega ≈ ∑ 中文"]


@pytest.fixture(scope="module")
def sp_tokenizer(shared_path: Callable[..., Path]) -> Tokenizer:
    return Tokenizer.from_file(str(shared_path("models", "stories260K", "tokenizer.json")))


@pytest.fixture(scope="module")
def story_lines(shared_path: Callable[..., Path]) -> list[str]:
    with open(shared_path("text", "tinystories_valid_dev.txt"), encoding="utf-8") as f:
        return [line.strip() for _, line in zip(range(400), f) if line.strip()][:60]


@pytest.fixture(scope="module")
def bytelevel_tokenizer() -> Tokenizer:
    """A small byte-level BPE (GPT-2 style) trained here; multi-byte chars split into bytes."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = ["the quick brown fox jumps over the lazy dog", "hello world", *MULTIBYTE] * 20
    tok.train_from_iterator(corpus, trainer=trainer)
    return tok


def _stream(tok: Tokenizer, ids: list[int], **kwargs) -> list[str]:
    detok = IncrementalDetokenizer(tok, **kwargs)
    return [detok.add(t) for t in ids] + [detok.flush()]


def _check_roundtrip(tok: Tokenizer, ids: list[int]) -> list[str]:
    pieces = _stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids)
    assert not any("\ufffd" in p for p in pieces), pieces
    return pieces


def test_sentencepiece_stories(sp_tokenizer: Tokenizer, story_lines: list[str]):
    for line in story_lines:
        _check_roundtrip(sp_tokenizer, sp_tokenizer.encode(line).ids)


def test_sentencepiece_leading_spaces(sp_tokenizer: Tokenizer):
    ids = sp_tokenizer.encode("Once upon a time, there was").ids
    pieces = _check_roundtrip(sp_tokenizer, ids)
    assert [p for p in pieces if p] == ["Once", " upon", " a", " time", ",", " there", " was"]
    _check_roundtrip(sp_tokenizer, sp_tokenizer.encode("  two  spaces\nand\n\nlines ").ids)


@pytest.mark.parametrize("text", MULTIBYTE)
def test_sentencepiece_byte_fallback_multibyte(sp_tokenizer: Tokenizer, text: str):
    ids = sp_tokenizer.encode(text).ids
    pieces = _check_roundtrip(sp_tokenizer, ids)
    assert "🙂" in pieces or "🙂" not in text  # emitted whole once its 4th byte arrives


@pytest.mark.parametrize("text", MULTIBYTE)
def test_bytelevel_multibyte(bytelevel_tokenizer: Tokenizer, text: str):
    ids = bytelevel_tokenizer.encode(text).ids
    _check_roundtrip(bytelevel_tokenizer, ids)


def test_bytelevel_every_split_point(bytelevel_tokenizer: Tokenizer):
    """Characters split over tokens: bytes of '🙂' as separate tokens are held back."""
    tok = bytelevel_tokenizer
    text = "a🙂b 日本"
    ids = tok.encode(text).ids
    pieces = _check_roundtrip(tok, ids)
    assert "".join(pieces) == text


def test_random_valid_texts(sp_tokenizer: Tokenizer, bytelevel_tokenizer: Tokenizer):
    rng = random.Random(0)
    alphabet = list("abc xyz,.!\n") + list("éü日本語🙂ΩЖ")
    for _ in range(100):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 30)))
        for tok in (sp_tokenizer, bytelevel_tokenizer):
            _check_roundtrip(tok, tok.encode(text).ids)


def test_special_tokens_skipped_midstream(sp_tokenizer: Tokenizer):
    ids = [
        *sp_tokenizer.encode("Once upon").ids,
        2,
        1,
        *sp_tokenizer.encode("a time", add_special_tokens=False).ids,
    ]
    _check_roundtrip(sp_tokenizer, ids)
    kept = "".join(_stream(sp_tokenizer, ids, skip_special_tokens=False))
    assert kept == sp_tokenizer.decode(ids, skip_special_tokens=False)
    assert "</s>" in kept


def test_prompt_context_keeps_first_space(sp_tokenizer: Tokenizer, bytelevel_tokenizer: Tokenizer):
    for tok in (sp_tokenizer, bytelevel_tokenizer):
        full = tok.encode("Once upon a time, there was a café 🙂 here").ids
        for split in (1, 3, 6, len(full) - 2):
            prompt, gen = full[:split], full[split:]
            detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
            out = "".join([detok.add(t) for t in gen] + [detok.flush()])
            assert out == tok.decode(full)[len(tok.decode(prompt)) :]
    detok = IncrementalDetokenizer(sp_tokenizer, prompt_ids=sp_tokenizer.encode("Once").ids)
    assert detok.add(sp_tokenizer.token_to_id("▁upon")) == " upon"


def test_extend_and_flush_partial(bytelevel_tokenizer: Tokenizer):
    tok = bytelevel_tokenizer
    ids = tok.encode("x🙂").ids
    detok = IncrementalDetokenizer(tok)
    head = detok.extend(ids[:-1])
    assert "\ufffd" not in head
    # Stopping mid-character: flush returns the replacement char, as decode() would.
    tail = detok.flush()
    assert head + tail == tok.decode(ids[:-1])
    assert tail.endswith("\ufffd")
