"""`python -m specport.samples.suffix_corpus`: the artifact's own answers as a corpus file that
`--suffix-corpus` reads back."""

import json

import pytest

from specport.samples.suffix_corpus import main
from tests.fixtures import add_chat_tokenizer


@pytest.mark.slow
def test_corpus_of_own_answers_round_trips(tiny_zoo, tmp_path, capsys):
    import specport

    chat = add_chat_tokenizer(tiny_zoo.artifact("llama"), tmp_path / "chat")
    messages = tmp_path / "msgs.txt"
    messages.write_text("\n\n".join(f"Tell me about boat number {i}." for i in range(10)))
    out = tmp_path / "corpus.jsonl"
    args = [str(chat), "--messages", str(messages), "--out", str(out), "--new-tokens", "8"]
    assert main([*args, "--threads", "1"]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 10 and all(set(r) == {"ids", "text"} for r in lines)
    model = specport.load(chat, threads=1, suffix_corpus=out)
    assert len(model.suffix_index) == sum(len(r["ids"]) + 1 for r in lines if r["ids"])
    assert main([*args, "--threads", "1"]) == 1  # never overwrites the file it wrote
    assert "exists" in capsys.readouterr().err


def test_too_low_a_limit_names_the_limit(tiny_zoo, tmp_path, capsys):
    chat = add_chat_tokenizer(tiny_zoo.artifact("llama"), tmp_path / "chat")
    messages = tmp_path / "msgs.txt"
    messages.write_text("\n\n".join(f"Tell me about boat number {i}." for i in range(10)))
    out = tmp_path / "corpus.jsonl"
    assert main([str(chat), "--messages", str(messages), "--out", str(out), "--limit", "4"]) == 1
    assert "a limit of 4 messages is too few" in capsys.readouterr().err
    assert not out.exists()
