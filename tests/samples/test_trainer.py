"""The demo tokenizer: Llama layout (specials, bytes, learned pieces), lossless, word-bounded."""

from __future__ import annotations

from tokenizers import Tokenizer, pre_tokenizers

from specport.core.corpus import generate_corpus
from specport.samples.trainer import SPECIAL_PIECES, train_tokenizer


def test_tokenizer_layout_and_round_trip():
    texts = generate_corpus(500)
    tok = train_tokenizer(texts, vocab_size=512)
    assert tok.get_vocab_size() == 512
    assert [tok.id_to_token(i) for i in range(4)] == SPECIAL_PIECES
    assert tok.id_to_token(4) == "<0x00>" and tok.id_to_token(259) == "<0xFF>"
    assert tok.encode("Once upon a time").ids[0] == tok.token_to_id("<s>")
    # Merges were learned inside words only, so splitting at spaces and punctuation (as during
    # training) changes nothing: the Llama-style pre-tokenizer needs no split of its own.
    split = Tokenizer.from_str(tok.to_str())
    split.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True),
            pre_tokenizers.Punctuation(behavior="isolated"),
        ]
    )
    samples = [*generate_corpus(200, seed=9), "Zoë paid 5€, ok? 😀", "a  b\n\tc"]
    for text in samples:
        ids = tok.encode(text).ids
        assert ids == split.encode(text).ids
        assert tok.decode(ids) == text
    # Words of the corpus are mostly single pieces: ~4-5 characters per token.
    chars = sum(len(t) for t in texts[:100])
    tokens = sum(len(tok.encode(t, add_special_tokens=False).ids) for t in texts[:100])
    assert chars / tokens > 3.5
