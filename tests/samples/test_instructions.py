"""The real requests specport ships: what `train-draft` answers by default, and the part it
holds apart to measure on."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from specport.core.prompt_files import read_prompt_file
from specport.samples import chat_prompts as bench
from specport.samples.chat_distill import prompts as builtin
from specport.samples.instructions import DATA, HELDOUT, TRAIN

# the self-instruct seed tasks as published (github:yizhongw/self-instruct, data/seed_tasks.jsonl
# at 0b26ccaa): the two files together are that file, byte for byte
SEED_TASKS_SHA256 = "7779004fa198fdf27cf70a159363879d8a26c53329e11b436af17b3941875f48"


def _ids(path: Path) -> list[str]:
    return [json.loads(line)["id"] for line in path.read_text().splitlines()]


def test_the_files_are_the_published_seed_tasks_unchanged():
    both = TRAIN.read_bytes() + HELDOUT.read_bytes()
    assert hashlib.sha256(both).hexdigest() == SEED_TASKS_SHA256


def test_the_split_is_the_sources_order_120_then_55():
    assert _ids(TRAIN) == [f"seed_task_{i}" for i in range(120)]
    assert _ids(HELDOUT) == [f"seed_task_{i}" for i in range(120, 175)]


@pytest.mark.parametrize("path, count", [(TRAIN, 120), (HELDOUT, 55)])
def test_each_part_reads_as_a_prompt_file_with_written_answers(path, count):
    records = read_prompt_file(path).records
    assert len(records) == count
    assert all(r.chat and r.turns[0].strip() and r.answer for r in records)
    assert len({r.turns[0] for r in records}) == count


def test_no_held_apart_or_benchmark_request_is_trained_on():
    train = {r.turns[0] for r in read_prompt_file(TRAIN).records}
    held = {r.turns[0] for r in read_prompt_file(HELDOUT).records}
    chat = set(bench.chat_prompts() + bench.chat_prompts(more=True))
    assert not train & held and not train & chat and not train & set(builtin())


def test_the_data_ships_in_the_package_with_its_source_and_licence():
    pyproject = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    section = pyproject.split("[tool.setuptools.package-data]", 1)[1].split("\n[", 1)[0]
    assert '"specport.samples" = ["data/*.jsonl", "data/README.md"]' in section
    readme = (DATA / "README.md").read_text()
    assert "yizhongw/self-instruct" in readme and "Apache License 2.0" in readme
