"""KVSlots: prefill in chunks on a row's own view equals one full prefill; rows stay independent."""

from __future__ import annotations

import numpy as np

from specport.runtime.engine.slots import KVSlots
from specport.runtime.kv.iobinding import BoundSession

PROMPT = np.array([1, 5, 6, 7, 8, 9, 10, 11, 12, 40, 41, 42, 43, 44, 45, 46, 47], dtype=np.int64)


def test_chunked_prefill_logits_match_full_prefill(shared_model):
    m = shared_model
    ref = BoundSession(m.session, m.manifest, 1, 64)
    want, want_id = ref.prefill(PROMPT[None, :], np.array([len(PROMPT)]))
    slots = KVSlots(m.session, m.manifest, 3, 64)
    full, full_id = slots.extend(0, PROMPT)
    for cut in ((5,), (1, 8, 16)):  # row 2: chunks of 5 + 12, then 1 + 7 + 8 + 1
        row = 2 if len(cut) == 1 else 1
        for lo, hi in zip((0, *cut), (*cut, len(PROMPT))):
            logits, greedy = slots.extend(row, PROMPT[lo:hi])
        np.testing.assert_allclose(logits, want[0], atol=1e-4, rtol=1e-4)
        assert greedy == int(want_id[0])
    np.testing.assert_allclose(full, want[0], atol=1e-5, rtol=1e-5)
    assert full_id == int(want_id[0])
    assert slots.lengths.tolist() == [len(PROMPT)] * 3
    for buf in slots.kv.buffers:  # the three rows hold the same KV, within fp32 noise
        np.testing.assert_allclose(buf[1, :, : len(PROMPT)], buf[0, :, : len(PROMPT)], atol=1e-5)
        np.testing.assert_allclose(buf[2, :, : len(PROMPT)], buf[0, :, : len(PROMPT)], atol=1e-5)


def test_decode_advances_live_rows_only_and_copy_moves_a_prefix(shared_model):
    m = shared_model
    slots = KVSlots(m.session, m.manifest, 3, 64)
    _, first = slots.extend(2, PROMPT[:6])
    before = [b[0:2].copy() for b in slots.kv.buffers]
    ids = np.array([0, 0, first])
    live = np.array([False, False, True])
    slots.decode(ids, live)
    assert slots.lengths.tolist() == [0, 0, 7]
    for old, buf in zip(before, slots.kv.buffers):  # dummy rows wrote only at position 0
        np.testing.assert_array_equal(old[:, :, 1:], buf[0:2, :, 1:])
    slots.copy(2, 0, 7)
    assert slots.lengths.tolist() == [7, 0, 7]
    a, _ = slots.decode(np.array([5, 0, 5]), np.array([True, False, True]))
    np.testing.assert_array_equal(a[0], a[2])  # same KV, same token: same logits
