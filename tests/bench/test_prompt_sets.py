"""`specport bench --speculative --prompts FILE`: a user's prompt file, rows per category, later
turns after the model's own answers, and the options that select from the file."""

from __future__ import annotations

import json

import pytest

from specport.cli import main

RECORDS = [
    {"category": "copy", "turns": ["the cat sat on the mat. the cat sat on the mat. the cat"]},
    {"category": "chat", "turns": ["Hello there.", "And then?"]},
    {"category": "copy", "turns": ["a b c d a b c d a b c d a b"]},
    {"category": "chat", "turns": ["What is up?"]},
]


def _bench(artifact, path, *extra):
    return main(
        [
            "bench",
            str(artifact),
            "--speculative",
            "ngram",
            "--prompts",
            str(path),
            "--new-tokens",
            "8",
            "--runs",
            "1",
            "--threads",
            "1",
            *extra,
        ]
    )


@pytest.fixture(scope="module")
def chat_artifact(tiny_llama_artifact, tmp_path_factory):
    """The tiny Llama with a real BPE tokenizer and a ChatML template."""
    from tests.fixtures import add_chat_tokenizer

    return add_chat_tokenizer(tiny_llama_artifact, tmp_path_factory.mktemp("chat") / "art")


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in RECORDS), encoding="utf-8")
    return path


def test_per_category_rows_in_json(chat_artifact, prompt_file, capsys):
    assert _bench(chat_artifact, prompt_file, "--json") == 0
    report = json.loads(capsys.readouterr().out)
    assert report["prompts"] == 5  # the chat record's second turn is a prompt of its own
    assert report["prompt_file"]["format"] == "turns"
    assert report["prompt_file"]["rendered"] == "chat template"
    groups = {g["category"]: g for g in report["categories"]}
    assert list(groups) == ["copy", "chat"]
    assert groups["copy"]["prompts"] == 2 and groups["chat"]["prompts"] == 3
    for group in groups.values():
        rows = {r["engine"]: r for r in group["rows"]}
        assert set(rows) == {"plain", "ngram"}
        assert rows["plain"]["speedup_vs_plain"] == 1.0
        assert rows["ngram"]["tokens_equal_plain"]
        assert rows["ngram"]["speedup_vs_plain"] > 0
        assert rows["ngram"]["mean_accepted_length"] >= 1.0
        assert 0.0 <= group["answer_ngrams_in_prompt"] <= 1.0
        assert rows["ngram"]["cpu_speedup_vs_plain"] > 0  # CPU time: steadier under load
    # the whole run's rows add up the categories' prompts
    assert [r["engine"] for r in report["rows"]] == ["plain", "ngram"]


def test_table_prints_a_row_per_category(chat_artifact, prompt_file, capsys):
    assert _bench(chat_artifact, prompt_file, "--prompts-limit", "1") == 0
    out = capsys.readouterr().out
    assert "per category: speed-up vs plain" in out
    lines = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert lines["copy"].split()[1] == "1" and lines["chat"].split()[1] == "2"  # 1 record each
    assert "tok/s" in lines["copy"]


def test_split_and_category_select_records(chat_artifact, tmp_path, capsys):
    path = tmp_path / "many.txt"  # paragraphs: no category, one group
    path.write_text("\n\n".join(f"prompt number {i} and more" for i in range(12)))
    halves = []
    for split in ("tune", "eval"):
        assert _bench(chat_artifact, path, "--prompts-split", split, "--json") == 0
        report = json.loads(capsys.readouterr().out)
        assert "categories" not in report
        halves.append(report["prompt_file"]["selected"])
    assert sum(halves) == 12 and all(halves)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--prompts-limit", "2"], "--prompts-limit selects from --prompts FILE"),
        (["--prompts", "{file}", "--prompt-set", "copy"], "drop --prompt-set"),
        (["--prompts", "{missing}"], "not found"),
        (["--prompts", "{file}", "--prompts-category", "math"], "its categories: copy, chat"),
    ],
)
def test_prompt_file_mistakes_are_one_line(
    chat_artifact, prompt_file, tmp_path, capsys, extra, message
):
    extra = [e.format(file=prompt_file, missing=tmp_path / "none.jsonl") for e in extra]
    rc = main(["bench", str(chat_artifact), "--speculative", "ngram", "--runs", "1", *extra])
    err = capsys.readouterr().err
    assert rc != 0 and message in err
    assert "Traceback" not in err


def test_copied_share_counts_answer_ngrams_found_in_the_prompt():
    from specport.bench.spec_tally import copied_share

    assert copied_share([1, 2, 3, 4], [2, 3, 4, 9]) == 0.5  # (2,3,4) yes, (3,4,9) no
    assert copied_share([1, 2, 3], [7, 8, 9, 7]) == 0.0
    assert copied_share([1, 2, 3], [1, 2]) is None  # no 3-gram in the answer
