"""Real requests shipped with specport: the 175 human-written self-instruct seed tasks.

What a draft head learns from decides what it drafts well: a head trained on the model's
answers to real requests drafted better on held-apart real requests than one trained on the
templated ``samples.chat_distill`` collection (docs/benchmarks/2026-12-05-drafter-data.md), so
``train-draft`` answers these by default. The tasks were written by the self-instruct authors
(Wang et al. 2023, github:yizhongw/self-instruct ``data/seed_tasks.jsonl``, Apache-2.0, the
licence of specport): varied everyday requests (advice, writing, code, maths, classification),
each an instruction with an optional input and a written answer.

The split is fixed in two files so it never moves: ``TRAIN``, the first 120 tasks in the
source's order (``seed_task_0`` .. ``seed_task_119``), what ``train-draft`` answers by default;
``HELDOUT``, the other 55, never trained on by default and measured at every point of the
training timeline, as the earlier data comparison held them apart. Both are prompt files
(``specport.core.prompt_files``): ``bench --prompts`` and ``train-draft --data`` read them as any
other. Source and licence: ``data/README.md``.
"""

from __future__ import annotations

from pathlib import Path

DATA = Path(__file__).with_name("data")
TRAIN = DATA / "self_instruct_train.jsonl"
HELDOUT = DATA / "self_instruct_heldout.jsonl"
SOURCE = "self-instruct seed tasks (github:yizhongw/self-instruct, Apache-2.0)"
