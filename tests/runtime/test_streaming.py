import numpy as np
import pytest

from specport.runtime.streaming import TextStreams

tokenizers = pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["the cat sat on the mat. héllo 日本語 🙂 STOP here"] * 20, trainer)
    return tok


def _run(tok, text, stop=()):
    ids = tok.encode(text).ids
    pieces: list[str] = []
    streams = TextStreams(tok, 1, stop, lambda row, piece: pieces.append(piece))
    stopped_at = None
    for i, t in enumerate(ids):
        hit = streams.push(np.array([t]), np.array([True]))
        if hit is not None and hit[0]:
            stopped_at = i
            break
    final = streams.finish()[0]
    return pieces, final, stopped_at


def test_streamed_pieces_equal_final_text(tokenizer):
    text = "the cat sat on the mat. héllo 日本語 🙂"
    pieces, final, _ = _run(tokenizer, text)
    assert "".join(pieces) == final == tokenizer.decode(tokenizer.encode(text).ids)
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_ends_row_and_is_not_emitted(tokenizer):
    pieces, final, stopped_at = _run(tokenizer, "the cat sat STOP here", stop=["STOP"])
    assert stopped_at is not None
    assert final == "the cat sat "
    assert "".join(pieces) == final


def test_possible_stop_prefix_is_held_back_then_released(tokenizer):
    pieces, final, stopped_at = _run(tokenizer, "the cat sat on the mat", stop=["the dog"])
    assert stopped_at is None
    assert final == "the cat sat on the mat"
