"""The KV interface on both layouts.

SharedKVCache: prefill in chunks on a row's own view equals one full prefill; rows stay
independent; a prefix copies between rows; a tree's path is kept in place. ConcatKVCache: every
live row's query attends to exactly its own positions, in order, through any mix of batched
steps, rollbacks, rows run alone, parked, freed, copied and swapped (a fake graph that reports
what each query sees), and a real concat graph's scores equal a one-run reference per row."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from specport.artifact.manifest import KVLayout, Manifest
from specport.core.errors import ContextLengthError, InputError
from specport.runtime.kv.cache import SharedKVCache, open_kv_cache
from specport.runtime.kv.concat_cache import ConcatKVCache
from specport.runtime.kv.iobinding import BoundSession
from specport.runtime.kv.seq_cache import open_cache

PROMPT = np.array([1, 5, 6, 7, 8, 9, 10, 11, 12, 40, 41, 42, 43, 44, 45, 46, 47], dtype=np.int64)


def test_chunked_prefill_logits_match_full_prefill(shared_model):
    m = shared_model
    ref = BoundSession(m.session, m.manifest, 1, 64)
    want, want_id = ref.prefill(PROMPT[None, :], np.array([len(PROMPT)]))
    slots = SharedKVCache(m.session, m.manifest, 3, 64)
    full, full_id = _extend(slots, 0, PROMPT)
    for cut in ((5,), (1, 8, 16)):  # row 2: chunks of 5 + 12, then 1 + 7 + 8 + 1
        row = 2 if len(cut) == 1 else 1
        for lo, hi in zip((0, *cut), (*cut, len(PROMPT))):
            logits, greedy = _extend(slots, row, PROMPT[lo:hi])
        np.testing.assert_allclose(logits, want[0], atol=1e-4, rtol=1e-4)
        assert greedy == int(want_id[0])
    np.testing.assert_allclose(full, want[0], atol=1e-5, rtol=1e-5)
    assert full_id == int(want_id[0])
    assert slots.lengths.tolist() == [len(PROMPT)] * 3
    for buf in slots.buffers:  # the three rows hold the same KV, within fp32 noise
        np.testing.assert_allclose(buf[1, :, : len(PROMPT)], buf[0, :, : len(PROMPT)], atol=1e-5)
        np.testing.assert_allclose(buf[2, :, : len(PROMPT)], buf[0, :, : len(PROMPT)], atol=1e-5)


def test_decode_advances_live_rows_only_and_copy_moves_a_prefix(shared_model):
    m = shared_model
    slots = SharedKVCache(m.session, m.manifest, 3, 64)
    _, first = _extend(slots, 2, PROMPT[:6])
    before = [b[0:2].copy() for b in slots.buffers]
    ids = np.array([0, 0, first])
    live = np.array([False, False, True])
    slots.step(ids[:, None], live)
    assert slots.lengths.tolist() == [0, 0, 7]
    for old, buf in zip(before, slots.buffers):  # dummy rows wrote only at position 0
        np.testing.assert_array_equal(old[:, :, 1:], buf[0:2, :, 1:])
    slots.copy_prefix(2, 0, 7)
    assert slots.lengths.tolist() == [7, 0, 7]
    a = slots.step(np.array([[5], [0], [5]]), np.array([True, False, True])).logits
    np.testing.assert_array_equal(a[0], a[2])  # same KV, same token: same logits
    slots.free(1)
    assert slots.lengths.tolist() == [8, 0, 8]


def test_keep_positions_moves_a_path_in_place_and_keep_rolls_back(shared_model):
    m = shared_model
    slots = SharedKVCache(m.session, m.manifest, 2, 64)
    _extend(slots, 1, PROMPT[:10])
    before = [b[1, :, :10].copy() for b in slots.buffers]
    slots.keep_positions(1, np.array([0, 1, 2, 3, 4, 5, 7, 9]))
    assert slots.lengths.tolist() == [0, 8]
    for old, buf in zip(before, slots.buffers):
        np.testing.assert_array_equal(buf[1, :, :8], old[:, [0, 1, 2, 3, 4, 5, 7, 9]])
    slots.keep(1, 3)
    assert slots.lengths.tolist() == [0, 3]
    slots.keep(1, 5)  # keep never grows a row
    assert slots.lengths.tolist() == [0, 3]


@pytest.mark.parametrize("held", [False, True], ids=["empty-rows", "a-row-holds-a-prefix"])
def test_prefill_rows_scores_each_rows_last_token_like_its_own_prefill(shared_model, held):
    """Three prompts of different lengths right-padded into rows [1, 4) in one run: each row's
    logits and KV are those of its prompt prefilled alone; rows 0 and 4 are untouched."""
    m = shared_model
    prompts = [PROMPT[:5], PROMPT, PROMPT[3:12]]
    ref = BoundSession(m.session, m.manifest, 1, 64)
    want = []
    for p in prompts:
        ref.reset()
        logits, greedy = ref.prefill(p[None, :], np.array([len(p)]))
        want.append((logits[0].copy(), None if greedy is None else int(greedy[0])))
    slots = SharedKVCache(m.session, m.manifest, 5, 64)
    start = [0, 0, 0]
    if held:  # row 2 holds its prompt's first 7 positions (a prefix-cache hit)
        _extend(slots, 2, PROMPT[:7])
        start[1] = 7
    before = [(b[0].copy(), b[4].copy()) for b in slots.buffers]
    chunks = [p[s:] for p, s in zip(prompts, start)]
    ids = np.zeros((3, max(len(c) for c in chunks)), dtype=np.int64)
    for i, c in enumerate(chunks):
        ids[i, : len(c)] = c
    out = slots.prefill_rows(1, ids, np.array([len(c) for c in chunks]))
    assert out.logits.shape == (3, 1, m.manifest.vocab_size)
    assert slots.lengths.tolist() == [0, 5, len(PROMPT), 9, 0]
    for i, (logits, greedy) in enumerate(want):
        np.testing.assert_allclose(out.logits[i, 0], logits, atol=1e-4, rtol=1e-4)
        if greedy is not None:
            assert int(out.greedy[i, 0]) == greedy
    for (row0, row4), buf in zip(before, slots.buffers):
        np.testing.assert_array_equal(buf[0], row0)
        np.testing.assert_array_equal(buf[4], row4)
    # the rows go on decoding like rows prefilled one by one
    nxt = slots.step(np.array([[0], [7], [8], [9]]), np.array([False, True, True, True]))
    alone = SharedKVCache(m.session, m.manifest, 1, 64)
    _extend(alone, 0, prompts[1])
    np.testing.assert_allclose(
        nxt.logits[2, 0], alone.step_row(0, np.array([8])).logits[0, 0], atol=1e-4, rtol=1e-4
    )


def _extend(slots, row, ids):
    """A prompt chunk on one row: the last position's logits [V] and greedy id."""
    out = slots.step_row(row, ids, last_only=True)
    return out.logits[0, -1].copy(), (None if out.greedy is None else int(out.greedy[0, -1]))


# ---------------------------------------------------------------- the concat layout


class _Named:
    def __init__(self, name: str) -> None:
        self.name = name


class FakeConcatGraph:
    """A concat graph whose keys are (position, token) and whose run records, per row and
    query, the (position, token) keys it may attend to (mask and causality)."""

    def __init__(self) -> None:
        self.seen: list[list[list[tuple[int, int]]]] = []
        self.runs = 0

    def get_inputs(self) -> list[_Named]:
        return [_Named(n) for n in ("input_ids", "attention_mask", "position_ids", "k0", "v0")]

    def get_outputs(self) -> list[_Named]:
        return [_Named(n) for n in ("logits", "pk0", "pv0")]

    def run(self, names: Any, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        ids, mask, pos = feeds["input_ids"], feeds["attention_mask"], feeds["position_ids"]
        past = feeds["k0"]
        b, s = ids.shape
        w = past.shape[2]
        assert mask.shape == (b, w + s) and pos.shape == (b, s) and past.shape[0] == b
        assert feeds["v0"].shape == past.shape
        new = np.stack([pos, ids], axis=-1).astype(np.float32)[:, None]  # [b, 1, S, 2]
        keys = np.concatenate([past, new], axis=2)
        self.seen = [
            [
                [
                    (int(keys[r, 0, j, 0]), int(keys[r, 0, j, 1]))
                    for j in range(w + i + 1)
                    if mask[r, j]
                ]
                for i in range(s)
            ]
            for r in range(b)
        ]
        self.runs += 1
        return [np.zeros((b, s, 16), np.float32), keys, keys.copy()]


def _fake_cache(rows: int, max_length: int = 64) -> tuple[ConcatKVCache, FakeConcatGraph]:
    layout = KVLayout(
        inputs=[["k0", "v0"]], outputs=[["pk0", "pv0"]], num_heads=[1], key_dim=[2], value_dim=[2]
    )
    manifest = Manifest("llama", {"vocab_size": 16, "context_length": 64}, {}, layout)
    graph = FakeConcatGraph()
    return ConcatKVCache(graph, manifest, rows, max_length), graph


class _Rows:
    """The test's own record of each row's (position, token) keys, checked against the graph."""

    def __init__(self, cache: ConcatKVCache, graph: FakeConcatGraph) -> None:
        self.cache, self.graph = cache, graph
        self.keys: list[list[tuple[int, int]]] = [[] for _ in range(cache.rows)]

    def step_row(self, row: int, ids: list[int]) -> None:
        n = len(self.keys[row])
        self.cache.step_row(row, np.array(ids))
        fed = [(n + i, t) for i, t in enumerate(ids)]
        assert self.graph.seen[0] == [self.keys[row] + fed[: i + 1] for i in range(len(ids))]
        self.keys[row] += fed

    def step(self, ids: list[list[int]], live: list[bool]) -> None:
        self.cache.step(np.array(ids), np.array(live))
        ran = [r for r, on in enumerate(live) if on]  # only live rows run, in row order
        assert len(self.graph.seen) == len(ran)
        for seen, r in zip(self.graph.seen, ran):
            n = len(self.keys[r])
            fed = [(n + i, t) for i, t in enumerate(ids[r])]
            want = [self.keys[r] + fed[: i + 1] for i in range(len(ids[r]))]
            assert seen == want, (r, seen, want)
            self.keys[r] += fed
        assert self.cache.lengths.tolist() == [len(k) for k in self.keys]

    def keep(self, row: int, n: int) -> None:
        self.cache.keep(row, n)
        self.keys[row] = self.keys[row][:n]


def test_concat_rows_attend_to_their_own_positions_through_every_operation():
    cache, graph = _fake_cache(3)
    rows = _Rows(cache, graph)
    rows.step_row(0, [5, 6, 7, 8, 9])  # a prompt alone
    rows.step_row(2, [3, 4])
    rows.step([[1, 2, 3], [4, 5, 6], [7, 8, 9]], [True, True, True])  # row 1 starts empty
    runs = graph.runs
    rows.step([[10], [11], [12]], [True, True, True])  # plain decode on aligned rows
    assert graph.runs == runs + 1
    rows.keep(0, 7)  # drafts rejected: rows end at different slots
    rows.keep(1, 2)
    rows.step([[1, 2], [3, 4], [5, 6]], [True, False, True])  # realigned; row 1 sits out
    rows.keep(2, len(rows.keys[2]) - 1)
    rows.step([[7, 8, 9, 10], [11, 12, 13, 14]], [True, True])  # row 2 past the batch: parked
    rows.step([[1], [2], [3]], [True, True, True])  # and merged back
    cache.keep_positions(1, np.array([0, 1, 3, 5]))  # a tree's path
    rows.keys[1] = [rows.keys[1][i] for i in (0, 1, 3, 5)]
    rows.step([[4, 5], [6, 7], [8, 9]], [True, True, True])
    cache.free(0)
    rows.keys[0] = []
    rows.step([[1], [2], [3]], [False, True, True])
    cache.copy_prefix(2, 0, 4)
    rows.keys[0] = rows.keys[2][:4]
    cache.swap(1, 2)
    rows.keys[1], rows.keys[2] = rows.keys[2], rows.keys[1]
    rows.step([[1, 2], [3, 4], [5, 6]], [True, True, True])
    rows.step_row(1, [9])
    rows.step([[1], [2], [3]], [True, True, True])
    cache.free(2)  # the last row ends: the next runs leave it out
    rows.keys[2] = []
    runs = graph.runs
    rows.step([[1], [2]], [True, True])
    assert graph.runs == runs + 1
    assert cache.width - int(cache.lengths.max()) <= 32  # the common padding stays bounded


def test_concat_cache_limits_and_errors():
    cache, _ = _fake_cache(2, max_length=4)
    cache.step_row(0, np.array([1, 2, 3, 4]))
    assert not cache.fits(1, 1) and cache.fits(2, 0)
    with pytest.raises(ContextLengthError, match="full"):
        cache.step(np.array([[1], [2]]), np.array([True, True]))
    with pytest.raises(InputError, match="--tree-mask"):
        cache.step_row(1, np.array([1, 2]), tree=(np.array([0, 1]), np.tri(2)))
    cache.reset()
    assert cache.lengths.tolist() == [0, 0]


def test_concat_cache_scores_equal_one_run_per_row(tiny_llama_artifact):
    """A real concat graph: ragged rows, rollbacks and rows sitting out; every live row's
    scores equal one run over its own tokens, and the factory picks the concat cache."""
    import specport

    m = specport.load(tiny_llama_artifact, threads=1)
    cache = open_kv_cache(m.session, m.manifest, 3, 64)
    assert isinstance(cache, ConcatKVCache)
    rng = np.random.default_rng(0)
    tokens: list[list[int]] = [[], [], []]
    for r, n in enumerate((6, 1, 3)):
        ids = rng.integers(3, 200, size=n).tolist()
        cache.step_row(r, np.array(ids), last_only=True)
        tokens[r] += ids
    for _ in range(8):
        s = int(rng.integers(1, 5))
        live = rng.random(3) < 0.8
        live[int(rng.integers(3))] = True
        ids = rng.integers(3, 200, size=(3, s))
        out = cache.step(ids, live)
        for r in np.flatnonzero(live).tolist():
            seq = tokens[r] + ids[r].tolist()
            want = open_cache(m.session, m.manifest).step(seq).logits[-s:]
            np.testing.assert_allclose(out.logits[r], want, atol=1e-4, rtol=1e-4)
            kept = len(tokens[r]) + int(rng.integers(1, s + 1))  # accepted some of the S
            cache.keep(r, kept)
            tokens[r] = seq[:kept]
