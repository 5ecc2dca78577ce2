"""Prompt files: every format the field's request sets come in, read into the same records;
categories, multi-turn records, the seeded tune/eval halves, and one-line errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from specport.core.errors import InputError
from specport.core.prompt_files import PromptRecord, read_prompt_file, select, split_of


def _jsonl(path: Path, records: list[object]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n", encoding="utf-8")
    return path


# (records, format, expected first record's turns, its context)
FORMATS = {
    "spec-bench turns": (
        [
            {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Shorter."]},
            {"question_id": 82, "category": "qa", "turns": ["Who wrote Hamlet?"]},
        ],
        "turns",
        ("Write a poem.", "Shorter."),
        (),
    ),
    "alpaca instruction + input": (
        [
            {"instruction": "Translate to French.", "input": "Good morning.", "output": "Bonjour."},
            {"instruction": "Name a colour.", "input": "", "output": "Blue."},
        ],
        "instruction",
        ("Translate to French.\n\nGood morning.",),
        (),
    ),
    "self-instruct instances": (
        [
            {
                "id": "seed_task_1",
                "instruction": "Sort the numbers.",
                "instances": [{"input": "3, 1, 2", "output": "1, 2, 3"}, {"input": "x"}],
            },
            {"id": "seed_task_2", "instruction": "Tell a joke.", "instances": [{"input": ""}]},
        ],
        "instruction",
        ("Sort the numbers.\n\n3, 1, 2",),
        (),
    ),
    "openai messages": (
        [
            {
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello!"},
                    {"role": "user", "content": [{"type": "text", "text": "Summarise: a b c"}]},
                    {"role": "assistant", "content": "a reference answer"},
                ]
            }
        ],
        "messages",
        ("Summarise: a b c",),
        (("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello!")),
    ),
    "sharegpt conversations": (
        [
            {
                "conversations": [
                    {"from": "system", "value": "Be brief."},
                    {"from": "human", "value": "Q"},
                    {"from": "gpt", "value": "A"},
                ]
            }
        ],
        "messages",
        ("Q",),
        (("system", "Be brief."),),
    ),
    "prompt key": ([{"prompt": "Once upon a time"}], "prompt", ("Once upon a time",), ()),
}

# the written answer each format's first record carries (what train-draft --data-kind text reads)
ANSWERS = {
    "spec-bench turns": None,
    "alpaca instruction + input": "Bonjour.",
    "self-instruct instances": "1, 2, 3",
    "openai messages": "a reference answer",
    "sharegpt conversations": "A",
    "prompt key": None,
}


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("container", ["jsonl", "json-array"])
def test_each_format_reads_into_turns_and_context(tmp_path, name, container):
    records, fmt, turns, context = FORMATS[name]
    path = tmp_path / "p.json"
    if container == "jsonl":
        _jsonl(path, records)
    else:
        path.write_text(json.dumps(records, indent=2), encoding="utf-8")
    pf = read_prompt_file(path)
    assert pf.format == fmt
    assert len(pf.records) == len(records)
    assert pf.records[0].turns == turns
    assert pf.records[0].context == context
    assert pf.records[0].answer == ANSWERS[name]
    assert pf.records[0].chat


def test_plain_text_paragraphs(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("First prompt\nstill the first.\n\n\n  Second prompt.  \n\n", encoding="utf-8")
    pf = read_prompt_file(path)
    assert pf.format == "paragraphs"
    assert [r.turns for r in pf.records] == [
        ("First prompt\nstill the first.",),
        ("Second prompt.",),
    ]
    assert pf.categories == []
    assert not any(r.chat for r in pf.records)


def test_categories_in_order_of_first_appearance(tmp_path):
    recs = [{"category": c, "turns": [f"q{i}"]} for i, c in enumerate("baab")]
    pf = read_prompt_file(_jsonl(tmp_path / "p.jsonl", recs))
    assert pf.categories == ["b", "a"]
    assert [r.category for r in pf.records] == ["b", "a", "a", "b"]


def test_later_turns_follow_the_answers_given():
    record = PromptRecord(("Q1", "Q2"), (("system", "S"),))
    assert record.messages() == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q1"},
    ]
    assert record.messages(["A1"])[-3:] == [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1"},
        {"role": "user", "content": "Q2"},
    ]
    assert record.text(["A1"]) == "S\n\nQ1\n\nA1\n\nQ2"
    with pytest.raises(ValueError):
        record.messages(["A1", "A2"])


def test_select_limits_per_category_in_file_order():
    recs = [PromptRecord((f"{c}{i}",), category=c) for i in range(4) for c in "xy"]
    kept = select(recs, limit=2)
    assert [r.turns[0] for r in kept] == ["x0", "y0", "x1", "y1"]
    assert select(recs) == recs


def test_tune_and_eval_halves_partition_and_do_not_move():
    recs = [PromptRecord((f"prompt {i}",), category="c" if i % 2 else None) for i in range(200)]
    tune = select(recs, split="tune", seed=3)
    held = select(recs, split="eval", seed=3)
    assert {r.turns for r in tune}.isdisjoint({r.turns for r in held})
    assert len(tune) + len(held) == 200
    assert 70 < len(held) < 130  # about half
    # a record keeps its side when the file is reordered or grows
    grown = [*reversed(recs), PromptRecord(("new",))]
    assert {r.turns for r in held} <= {r.turns for r in select(grown, split="eval", seed=3)}
    # another seed draws other halves
    assert select(recs, split="eval", seed=4) != held
    assert split_of(recs[0], 3) == split_of(recs[0], 3)


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "not found"),
        (b"\xff\xfe bad bytes", "not UTF-8"),
        ('{"turns": ["a"]}\n{"turns": ["b"\n', "line 2: not JSON"),
        ('{"question": "no known key"}\n', "line 1: no prompt in it (keys: question)"),
        ('{"turns": []}\n', "`turns` must be a non-empty list"),
        ('{"turns": ["ok", 3]}\n', "`turns` must be a non-empty string"),
        ('{"messages": [{"role": "bot", "content": "x"}]}\n', "role of system, user, assistant"),
        ('{"messages": [{"role": "system", "content": "x"}]}\n', "no user message"),
        ("[1, 2]", "record 1: expected a JSON object"),
        ("\n\n  \n", "no prompts in it"),
    ],
)
def test_bad_files_get_one_line_errors(tmp_path, content, message):
    path = tmp_path / "p.jsonl"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content, encoding="utf-8")
    with pytest.raises(InputError, match=re.escape(message)) as e:
        read_prompt_file(path, option="--data")
    assert "\n" not in str(e.value) and str(e.value).startswith(f"--data {path}")


def test_a_folder_is_not_a_prompt_file(tmp_path):
    with pytest.raises(InputError, match="a folder"):
        read_prompt_file(tmp_path)


@pytest.mark.shared
def test_shared_self_instruct_seed_tasks(shared_path):
    """The 175 human-written instructions: the instruction, then the first instance's input."""
    pf = read_prompt_file(shared_path("text", "prompts", "self_instruct_seed_tasks.jsonl"))
    assert pf.format == "instruction" and len(pf.records) == 175
    with_input = [r for r in pf.records if "\n\n" in r.turns[0]]
    assert 0 < len(with_input) < 175
    assert all(len(r.turns) == 1 and r.category is None for r in pf.records)
