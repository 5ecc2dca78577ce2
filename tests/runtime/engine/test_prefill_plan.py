"""The prefill planner: which rows' prompt chunks run together (consecutive rows, few runs,
little padding, within the token cap and the rows' room)."""

from __future__ import annotations

from specport.runtime.engine.prefill_plan import RUN_TOKENS, Chunk, groups, padded


def _rows(gs):
    return [[c.row for c in g] for g in gs]


def test_consecutive_rows_of_similar_lengths_run_together():
    chunks = [Chunk(r, 0, n) for r, n in zip(range(5), [7, 9, 8, 6, 9])]
    assert _rows(groups(chunks, 512, 128, batched=True)) == [[0, 1, 2, 3, 4]]


def test_a_gap_in_the_rows_splits_the_block():
    chunks = [Chunk(0, 0, 5), Chunk(1, 0, 5), Chunk(3, 0, 5), Chunk(4, 0, 5)]
    assert _rows(groups(chunks, 512, 128, batched=True)) == [[0, 1], [3, 4]]


def test_a_long_prompt_runs_apart_when_its_padding_costs_more_than_a_run():
    short = [Chunk(r, 0, 4) for r in range(6)]
    long = Chunk(6, 0, 60)
    got = groups([*short, long], 4096, 128, batched=True)
    assert _rows(got) == [[0, 1, 2, 3, 4, 5], [6]]
    # the cut is cheaper than one padded run, and one run cheaper than every row alone
    one_run = RUN_TOKENS + 7 * 60
    assert sum(RUN_TOKENS + padded(g) for g in got) < one_run


def test_token_cap_bounds_a_group_but_a_chunk_alone_always_runs():
    chunks = [Chunk(r, 0, 8) for r in range(8)]
    got = groups(chunks, 32, 128, batched=True)
    assert all(padded(g) <= 32 for g in got) and sum(len(g) for g in got) == 8
    assert _rows(groups([Chunk(0, 0, 100)], 32, 128, batched=True)) == [[0]]


def test_rows_holding_kv_group_only_on_graphs_with_batched_steps():
    chunks = [Chunk(0, 0, 5), Chunk(1, 12, 5), Chunk(2, 0, 5), Chunk(3, 0, 5)]
    assert _rows(groups(chunks, 512, 128, batched=True)) == [[0, 1, 2, 3]]
    assert _rows(groups(chunks, 512, 128, batched=False)) == [[0], [1], [2, 3]]


def test_padding_must_fit_in_every_rows_room():
    # row 1 holds 120 of 128 positions: padded to 9 tokens it would not fit
    chunks = [Chunk(0, 0, 9), Chunk(1, 120, 2)]
    got = groups(chunks, 512, 128, batched=True)
    assert _rows(got) == [[0], [1]]
