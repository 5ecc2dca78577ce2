"""--suffix-record: learned answers appended to a corpus file (never rewriting it), read back
by `read_corpus`; a file that is not a corpus is refused up front; a failing disk stops the
recording with one warning instead of failing the answers."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from specport.core.errors import InputError
from specport.runtime.speculative.suffix import SuffixIndex
from specport.runtime.speculative.suffix_corpus import read_corpus
from specport.runtime.speculative.suffix_record import (
    SuffixRecorder,
    check_record,
    corpus_to_read,
)


def _learn(path: Path, answers: list[list[int]], learn: bool = True) -> SuffixRecorder:
    index = SuffixIndex()
    index.learn = learn
    recorder = SuffixRecorder(path)
    index.recorder = recorder
    for answer in answers:
        index.learn_answer(answer)
    recorder.close()
    return recorder


def test_learned_answers_are_appended_and_read_back(tmp_path):
    path = tmp_path / "learned.jsonl"
    assert check_record(path) == -1  # missing: created on the first answer's way in
    _learn(path, [[5, 6, 7], [8, 9]])
    assert read_corpus(path, None, 10) == [[5, 6, 7], [8, 9]]
    assert check_record(path) == 9
    before = path.read_text()
    _learn(path, [[1, 2]])
    assert path.read_text() == before + json.dumps({"ids": [1, 2]}) + "\n"


def test_existing_text_lines_stay_and_a_missing_newline_is_added(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text('{"text": "Sure! Here are"}\n{"ids": [3]}')
    _learn(path, [[4, 4]])
    assert path.read_text() == '{"text": "Sure! Here are"}\n{"ids": [3]}\n{"ids": [4, 4]}\n'


def test_nothing_is_recorded_while_learning_is_off(tmp_path):
    path = tmp_path / "learned.jsonl"
    assert _learn(path, [[1, 2]], learn=False).recorded == 0
    assert path.read_text() == ""


@pytest.mark.parametrize(
    "content, words",
    [
        ("my notes\n", "notes.jsonl:1: not a JSON object"),
        ('{"ids": [1]}\n[1, 2]\n', "notes.jsonl:2: each line needs"),
        ('{"ids": [1, -2]}\n', "non-negative token ids"),
        (b"\xff\xfe", "not UTF-8"),
    ],
)
def test_a_file_that_is_not_a_corpus_is_refused(tmp_path, content, words):
    path = tmp_path / "notes.jsonl"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    with pytest.raises(InputError, match=words):
        check_record(path)


def test_paths_that_cannot_be_a_record(tmp_path):
    with pytest.raises(InputError, match="is not a file"):
        check_record(tmp_path)
    with pytest.raises(InputError, match="does not exist"):
        check_record(tmp_path / "gone" / "r.jsonl")


def test_the_record_as_its_own_corpus_starts_empty_while_new(tmp_path):
    path = tmp_path / "learned.jsonl"
    assert corpus_to_read(str(path), str(path)) is None  # first start: nothing yet
    path.write_text("\n")
    assert corpus_to_read(str(path), str(path)) is None
    path.write_text('{"ids": [1]}\n')
    assert corpus_to_read(str(path), str(tmp_path / "." / "learned.jsonl")) == str(path)
    assert corpus_to_read(str(tmp_path / "other.jsonl"), str(path)) == str(
        tmp_path / "other.jsonl"
    )  # a different corpus must exist (load says so)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_a_failing_disk_warns_once_and_stops_recording(caplog):
    index = SuffixIndex()
    recorder = SuffixRecorder("/dev/full")  # every write fails with ENOSPC
    index.recorder = recorder
    with caplog.at_level(logging.WARNING):
        for answer in ([1, 2], [3, 4], [5, 6]):
            index.learn_answer(answer)  # never raises into the caller
        recorder.close()
    warnings = [r for r in caplog.records if "--suffix-record" in r.getMessage()]
    assert len(warnings) == 1 and "no longer recorded" in warnings[0].getMessage()
    assert recorder.recorded == 0 and len(index) == 9  # the index still learned all three


def test_ray_replicas_record_to_the_file(tiny_llama_artifact, tmp_path):
    """What each Ray Serve replica builds (no Ray needed: the class is plain until deployed):
    its engine's learned answers go to the shared record file, after what it held."""
    import specport
    from specport.ray_serve import SpecportReplica
    from specport.runtime.engine.base import Request
    from specport.runtime.serve.state import ServeSettings

    record = tmp_path / "learned.jsonl"
    record.write_text('{"ids": [1, 2, 3]}\n')
    want = specport.load(tiny_llama_artifact).generate(prompt_ids=[4, 5], max_new_tokens=6)
    options = {"speculative": "suffix", "max_batch": 1}
    replica = SpecportReplica(
        str(tiny_llama_artifact), ServeSettings(), options, "cpu", 1, str(record), str(record)
    )
    try:
        assert len(replica.specport_model.suffix_index) == 4  # restored from the record
        got = replica.specport_engine.submit(Request([4, 5], 6)).result(timeout=60)
        assert got.token_ids == want.tokens
    finally:
        replica.specport_engine.close()
        replica.specport_recorder.close()
    assert record.read_text() == '{"ids": [1, 2, 3]}\n' + json.dumps({"ids": want.tokens}) + "\n"
