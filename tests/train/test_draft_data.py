"""Training data for draft heads: the files people have, read as text by prefill, and
`train_draft --data-kind text|mixed` end to end on a tiny chat model (seconds)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from specport.train.draft_data import Example, read_examples, text_sequences

RECORDS = {
    "alpaca.json": (
        json.dumps([{"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"}]),
        Example("Add the numbers.\n\n2 and 3", "5"),
    ),
    "gpteacher.json": (
        json.dumps([{"instruction": "Greet me.", "input": "", "response": "Hello!"}]),
        Example("Greet me.", "Hello!"),
    ),
    "self_instruct.jsonl": (
        json.dumps(
            {"instruction": "Name a colour.", "instances": [{"input": "", "output": "Blue."}]}
        ),
        Example("Name a colour.", "Blue."),
    ),
    "openai.jsonl": (
        json.dumps(
            {
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Hi?"},
                    {"role": "assistant", "content": "Hi."},
                ]
            }
        ),
        Example("Hi?", "Hi."),
    ),
    "sharegpt.json": (
        json.dumps(
            [{"conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}]}]
        ),
        Example("Q", "A"),
    ),
    "mt_bench.jsonl": (
        json.dumps({"category": "writing", "turns": ["Write a poem.", "Shorter."]}),
        Example("Write a poem.", None),
    ),
    "plain.txt": (
        "First paragraph.\n\nSecond\nparagraph.\n",
        Example("First paragraph.", None, chat=False),
    ),
}


@pytest.mark.parametrize("name", sorted(RECORDS))
def test_read_examples_reads_the_formats_people_have(tmp_path, name):
    text, first = RECORDS[name]
    path = tmp_path / name
    path.write_text(text)
    examples = read_examples(path)
    assert examples[0] == first
    if name == "plain.txt":
        assert examples[1] == Example("Second\nparagraph.", None, chat=False)


def test_read_examples_names_the_record_it_cannot_read(tmp_path):
    from specport.core.errors import InputError

    path = tmp_path / "odd.jsonl"
    path.write_text(json.dumps({"instruction": "x", "output": "y"}) + "\n" + json.dumps({"q": 1}))
    with pytest.raises(InputError, match="line 2: no prompt in it"):
        read_examples(path)


def test_text_sequences_learn_the_written_answer_after_the_rendered_prompt():
    render = lambda text: [100, *map(ord, text), 101]  # noqa: E731
    encode = lambda text: list(map(ord, text))  # noqa: E731
    examples = [
        Example("ab", "xyz"),
        Example("only a prompt"),  # nothing written to learn: a prompt to answer
        Example("long", "0123456789"),
        Example("plain text here", chat=False),
    ]
    seqs, starts = text_sequences(examples, render, encode, new_tokens=4, end=[2])
    assert seqs[0] == [100, *map(ord, "ab"), 101, *map(ord, "xyz"), 2]
    assert starts[0] == 4  # the answer's first token follows the rendered prompt
    assert seqs[1] == [100, *map(ord, "long"), 101, *map(ord, "0123")]  # cut like an answer
    assert seqs[2] == list(map(ord, "plain"))  # new_tokens + 1 tokens, every one learned
    assert starts[2] == 1
    assert len(seqs) == 3
    # no chat template: everything is plain text, prompt and answer together
    seqs, starts = text_sequences(examples[:1], None, encode, new_tokens=8)
    assert seqs == [list(map(ord, "ab\n\nxyz"))] and starts == [1]


@pytest.fixture(scope="module")
def chat_artifact(tiny_zoo, tmp_path_factory) -> Path:
    from tests.fixtures import add_chat_tokenizer

    return add_chat_tokenizer(tiny_zoo.artifact("llama"), tmp_path_factory.mktemp("data") / "chat")


def _data(path: Path, n: int) -> Path:
    rows = [
        {"instruction": f"tell me about the number {i}", "output": f"The number {i} is {i % 7}."}
        for i in range(n)
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


@pytest.mark.parametrize("kind", ["text", "mixed"])
def test_train_draft_learns_the_targets_own_choices_over_written_text(
    chat_artifact, tmp_path, kind
):
    """The written answers go into the feature cache after their rendered prompts (mixed: after
    the model's own answers to the first half), and every position's label is the target's own
    greedy choice there, from the same run as the features."""
    import specport
    from specport.drafting import train_draft, training_dir
    from specport.runtime.kv.seq_cache import open_cache as open_kv
    from specport.train.draft_data import end_of_turn
    from specport.train.eagle_cache import open_cache

    data = _data(tmp_path / "data.jsonl", 32)
    out = tmp_path / "drafted"
    manifest = train_draft(
        chat_artifact, out, data=data, data_kind=kind, minutes=0.1, sequences=32,
        new_tokens=8, threads=1, progress=False, max_steps=4,
    )  # fmt: skip
    training = manifest.extra["eagle"]["training"]
    assert training["data_kind"] == kind
    cache = open_cache(training_dir(out) / "features")
    answered = 16 if kind == "mixed" else 0
    assert cache.num_sequences == answered + 32
    model = specport.load(out, threads=1)
    from types import SimpleNamespace

    from specport.core.chat_template import load_chat_template

    template = load_chat_template(SimpleNamespace(tokenizer=model.tokenizer, path=out))
    end = end_of_turn(template, model.encode)
    for j, ex in enumerate(read_examples(data)[:3]):
        _, tokens, choices, start = cache.sequence(answered + j)
        prompt = template.render_ids([{"role": "user", "content": ex.prompt}])
        assert list(tokens) == (prompt + (model.encode(ex.answer) + end)[:8])
        assert start == len(prompt)
        logits = open_kv(model.session, model.manifest, len(tokens) + 1).step(list(tokens)).logits
        assert np.array_equal(choices, np.asarray(logits[: len(tokens)]).argmax(-1))


def test_train_draft_text_needs_written_text(chat_artifact, tmp_path):
    """The templated collection and a file of prompts alone have no written text to read (the
    shipped self-instruct requests, the default, do)."""
    from specport.core.errors import InputError, UsageError
    from specport.drafting import train_draft

    with pytest.raises(UsageError, match="--data-kind text reads written answers"):
        train_draft(
            chat_artifact, tmp_path / "a", messages="builtin", data_kind="text", minutes=0.1
        )
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"turns": [f"question {i}"]}) for i in range(20)))
    with pytest.raises(InputError, match="0 examples with written text"):
        train_draft(chat_artifact, tmp_path / "b", data=prompts, data_kind="text", minutes=0.1)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_the_command_says_in_one_line_that_text_needs_a_file(chat_artifact, tmp_path, capsys):
    from specport.cli import main

    out = tmp_path / "drafted"
    assert main(["train-draft", str(chat_artifact), "--out", str(out),
                 "--messages", "builtin", "--data-kind", "text"]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert "--data-kind text reads written answers" in err and "Traceback" not in err
    assert not out.exists()
