"""The KV interface (SharedKVCache): prefill in chunks on a row's own view equals one full prefill;
rows stay independent; a prefix copies between rows; a tree's path is kept in place."""

from __future__ import annotations

import numpy as np

from specport.runtime.kv.cache import SharedKVCache
from specport.runtime.kv.iobinding import BoundSession

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


def _extend(slots, row, ids):
    """A prompt chunk on one row: the last position's logits [V] and greedy id."""
    out = slots.step_row(row, ids, last_only=True)
    return out.logits[0, -1].copy(), (None if out.greedy is None else int(out.greedy[0, -1]))
