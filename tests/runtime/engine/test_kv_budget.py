"""Admission by KV memory: how many rows the engine reserves and when a request may start.

What users rely on: `specport serve` without `--max-batch` takes many concurrent requests
(not a fixed 8), never admits more KV than `--kv-cache-space`, and a request that has to wait
for space still gets exactly the tokens it would get alone.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from specport.runtime.engine import make_engine
from specport.runtime.engine.admission import PREEMPTION_MODES
from specport.runtime.engine.base import Request
from specport.runtime.engine.kv_budget import (
    MAX_ROWS,
    KVBudget,
    plan_rows,
    token_bytes,
    total_memory,
)
from specport.runtime.sampler import SamplingConfig

PROMPTS = [[1, 74, 75, 76, 90], [1, 100], [1, 5, 6, 7, 8, 9, 10, 11, 12], [1, 3, 4] * 5]
NEW = 10


def test_budget_admits_while_reservations_fit():
    budget = KVBudget(space=100 * 8, per_token=8)  # 100 tokens
    assert budget.capacity == 100
    assert budget.admits(150)  # alone: always (its row was checked against the KV length)
    budget.reserve(0, 60)
    assert budget.admits(40) and not budget.admits(41)
    budget.reserve(1, 40)
    budget.move(1, 5)
    assert budget.reserved == {0: 60, 5: 40}
    budget.release(0)
    assert budget.admits(60) and budget.used == 40


def test_rows_fill_half_the_memory_at_most(shared_model):
    manifest = shared_model.manifest
    assert plan_rows(manifest, 64, max_batch=3) == 3  # an explicit --max-batch wins
    per_row = token_bytes(manifest) * 64
    rows = plan_rows(manifest, 64)
    memory = total_memory()
    assert memory is not None
    assert 1 <= rows <= MAX_ROWS and rows * per_row <= memory // 2


def test_token_bytes_counts_every_layer_key_and_value(shared_model):
    kv = shared_model.manifest.kv
    expected = sum(
        h * (k + v) * np.dtype(d).itemsize
        for h, k, v, d in zip(kv.num_heads, kv.key_dim, kv.value_dim, kv.dtypes())
    )
    assert token_bytes(shared_model.manifest) == expected


@pytest.mark.parametrize("space_tokens", [None, 1, 30])
def test_requests_beyond_the_space_wait_and_keep_their_tokens(shared_model, space_tokens):
    """1 token of space: one request at a time; 30: two of these at a time; default: all."""
    reference = [
        shared_model.generate(prompt_ids=p, max_new_tokens=NEW, ignore_eos=True).tokens
        for p in PROMPTS
    ]
    per_token = token_bytes(shared_model.manifest)
    space = None if space_tokens is None else space_tokens * per_token
    engine = make_engine(shared_model, kind="batching", max_length=48, kv_space=space)
    try:
        handles = [engine.submit(Request(p, NEW, ignore_eos=True)) for p in PROMPTS]
        got = [h.result(timeout=120).token_ids for h in handles]
        stats = engine.stats()
    finally:
        engine.close()
    assert got == reference
    assert stats["max_batch"] >= len(PROMPTS)  # rows by memory, not a fixed 8
    assert stats["kv_reserved_tokens"] == 0  # every reservation released
    if space_tokens is not None:
        assert stats["kv_space_tokens"] == space_tokens


@pytest.mark.parametrize("preemption", PREEMPTION_MODES)
def test_committed_kv_stays_within_the_space(shared_model, preemption):
    """When rows filled to the end would not fit the space, the rows' pages (running requests'
    and finished ones' kept for the prefix cache) stay within it: rows past what their request
    may write are trimmed and idle rows released, least recently used first, and every
    request still gets its tokens alone. Polled while 12 requests share a prefix."""
    prefix = list(range(1, 40))
    prompts = [[*prefix, 50 + i, 60 + i] for i in range(12)]
    reference = [
        shared_model.generate(prompt_ids=p, max_new_tokens=NEW, ignore_eos=True).tokens
        for p in prompts
    ]
    engine = make_engine(shared_model, kind="batching", max_length=128, kv_space=1)
    assert engine.small_pages  # 1 byte: nothing fits whole
    per_row = int(engine.kv.commit_bytes(len(prompts[0]) + NEW))
    engine.close()
    space = 3 * per_row  # three requests' rows at a time
    engine = make_engine(
        shared_model, kind="batching", max_length=128, kv_space=space, preemption=preemption
    )
    # a row admitted copies its prefix before the others are released; a free row inside a
    # decode batch is written one position
    slack = per_row + engine.max_batch * int(engine.kv.commit_bytes(1))
    try:
        handles = [engine.submit(Request(p, NEW, ignore_eos=True)) for p in prompts]
        held = []
        while not all(h.done for h in handles):
            held.append(engine.stats()["kv_held_bytes"])
        got = [h.result(timeout=120).token_ids for h in handles]
        stats = engine.stats()
    finally:
        engine.close()
    assert got == reference
    assert max([*held, stats["kv_held_bytes"]]) <= space + slack
    assert stats["kv_rows_released"] > 0 and stats["prefix_cache_hits"] > 0


# prompts of 7-31 tokens and answers of 40-66: rows start in their first 4 KiB page per head
# (64 positions at head_dim 16) and most grow into a second one while they decode
MIX = [[1, *((7 * i + 13 * j) % 250 + 3 for j in range(6 + (5 * i) % 26))] for i in range(16)]
MIX_NEW = [40 + (9 * i) % 27 for i in range(16)]
SEEDED = {3: 7, 6: 11}  # request -> seed: sampled (temperature 1.5, top-k 50), not greedy


def _sampled(i: int) -> dict:
    """Request `i`'s sampling settings (empty: greedy)."""
    return {"temperature": 1.5, "top_k": 50, "seed": SEEDED[i]} if i in SEEDED else {}


def _sampling(i: int) -> SamplingConfig:
    return SamplingConfig(greedy=False, **_sampled(i)) if i in SEEDED else SamplingConfig()


@pytest.fixture(scope="module")
def mix_reference(shared_model):
    return [
        shared_model.generate(prompt_ids=p, max_new_tokens=n, ignore_eos=True, **_sampled(i)).tokens
        for i, (p, n) in enumerate(zip(MIX, MIX_NEW))
    ]


def _run_mix(model, **options):
    """Every MIX request submitted at once: (each one's events, the last stats, the KV pages
    held as polled while they ran). Speculating rows verify one by one unless told."""
    engine = make_engine(model, kind="batching", **{"spec_max_rows": 64, **options})
    space = engine.budget.space
    try:
        handles = [
            engine.submit(Request(p, n, sampling=_sampling(i), ignore_eos=True))
            for i, (p, n) in enumerate(zip(MIX, MIX_NEW))
        ]
        held = []
        while not all(h.done for h in handles):
            stats = engine.stats()
            held.append(stats["kv_held_bytes"])
            assert stats["kv_reserved_bytes"] <= space or stats["running"] == 1
        events = [list(h.events(timeout=120)) for h in handles]
        stats = engine.stats()
    finally:
        engine.close()
    return events, stats, [*held, stats["kv_held_bytes"]]


@pytest.mark.parametrize(
    ("preemption", "speculative", "spec_max_rows"),
    [
        ("none", None, None),
        ("recompute", None, None),
        ("recompute", "ngram", 64),  # rows verify one by one
        ("recompute", "ngram", 1),  # rows verify together, at a width the step cost picks
    ],
)
def test_preempted_requests_keep_their_tokens(
    shared_model, mix_reference, preemption, speculative, spec_max_rows
):
    """A KV space of 5 rows' first pages: by default (`none`) each request reserves its prompt
    plus max tokens (most: two pages), so 2-3 run at a time, never preempted; with `recompute`
    each reserves what it holds, more start, and as rows grow into their second page the
    newest is preempted (6-7 times here) and later resumes. Either way every request gets the
    tokens it gets alone (greedy, and seeded sampling: with speculation, the seeded tokens of
    the same engine unpressed), once each, with its finish reason and usage."""
    probe = make_engine(shared_model, kind="batching", kv_space=1)
    page = int(probe.kv.commit_bytes(1))  # a row's first page per head, every layer
    assert probe.small_pages
    max_batch = probe.max_batch
    probe.close()
    reference: list[list[int] | None] = list(mix_reference)
    spec = {"speculative": speculative, "spec_max_rows": spec_max_rows or 64}
    if spec_max_rows == 1:  # the width follows the clock: only greedy tokens are reproducible
        for i in SEEDED:
            reference[i] = None
    elif speculative:  # sampling through rejection sampling: its own reproducible stream
        alone, _, _ = _run_mix(shared_model, **spec)
        for i in SEEDED:
            reference[i] = [t for ev in alone[i] for t in ev.token_ids]
    events, stats, held = _run_mix(shared_model, kv_space=5 * page, preemption=preemption, **spec)
    for i, evs in enumerate(events):
        assert sum(len(ev.token_ids) for ev in evs) == MIX_NEW[i], i
        if reference[i] is not None:
            assert [t for ev in evs for t in ev.token_ids] == reference[i], i
        assert [ev.finish_reason for ev in evs] == [None] * (len(evs) - 1) + ["length"], i
    assert stats["finished"] == len(MIX) and stats["errors"] == 0
    assert stats["generated_tokens"] == sum(MIX_NEW)  # none drawn twice
    assert stats["prompt_tokens"] == sum(len(p) for p in MIX)  # once each, resumed or not
    assert stats["kv_reserved_tokens"] == 0 and stats["waiting"] == 0
    # the pages committed stay within the space (plus a page per head of free rows that a
    # decode batch writes one position into)
    assert max(held) <= 5 * page + max_batch * page
    if preemption == "none":
        assert stats["preemptions"] == 0 and stats["recomputed_tokens"] == 0
    else:
        assert stats["preemptions"] > 0 and stats["recomputed_tokens"] > 0
    if speculative:
        assert stats["spec_steps"] > 0
    if spec_max_rows == 1:
        assert stats["spec_batched_steps"] > 0


def test_recompute_runs_more_requests_at_once(shared_model):
    """The point of `recompute`: at the same KV space more requests decode together (counted
    per decode step, not timed), because none holds space for tokens it has not written."""
    probe = make_engine(shared_model, kind="batching", kv_space=1)
    page = int(probe.kv.commit_bytes(1))
    probe.close()
    rows = {
        mode: _run_mix(shared_model, kv_space=5 * page, preemption=mode)[1]["mean_decode_rows"]
        for mode in ("none", "recompute")
    }
    assert rows["recompute"] > 1.2 * rows["none"], rows


def test_cancelling_preempted_requests_loses_none(shared_model):
    """Requests cancelled once preemption started (some running, some back in the queue with
    their state) each end once, "cancelled" or finished, and their KV space is handed back."""
    probe = make_engine(shared_model, kind="batching", kv_space=1)
    page = int(probe.kv.commit_bytes(1))
    probe.close()
    engine = make_engine(shared_model, kind="batching", kv_space=3 * page, preemption="recompute")
    try:
        handles = [engine.submit(Request(p, n, ignore_eos=True)) for p, n in zip(MIX, MIX_NEW)]
        while engine.stats()["preemptions"] == 0 and not all(h.done for h in handles):
            time.sleep(0.001)
        for handle in handles:
            handle.cancel()
        ends = [[ev.finish_reason for ev in h.events(timeout=60)] for h in handles]
        stats = engine.stats()
    finally:
        engine.close()
    for end in ends:
        assert end[:-1] == [None] * (len(end) - 1) and end[-1] in ("cancelled", "length")
    assert stats["cancelled"] + stats["finished"] == len(MIX) and stats["errors"] == 0
    assert stats["kv_reserved_tokens"] == 0 and stats["waiting"] == 0 and stats["running"] == 0
