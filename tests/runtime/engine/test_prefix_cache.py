"""PrefixCache placement: lowest free row, longest shared prefix, caches moved before reuse."""

from __future__ import annotations

import numpy as np

from specport.runtime.engine.prefix_cache import PrefixCache, common_prefix


def ids(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=np.int64)


def test_common_prefix():
    assert common_prefix(ids(1, 2, 3), ids(1, 2, 4)) == 2
    assert common_prefix(ids(1, 2), ids(1, 2, 4)) == 2
    assert common_prefix(ids(), ids(1)) == 0


def test_plan_reuses_the_longest_prefix_in_the_lowest_row():
    cache = PrefixCache(4)
    lengths = np.array([0, 5, 3, 0])
    cache.set(1, ids(1, 2, 3, 4, 5))
    cache.set(2, ids(1, 2, 9))
    plan = cache.plan(ids(1, 2, 3, 4, 7, 8), free=[0, 1, 2, 3], lengths=lengths)
    assert (plan.row, plan.source, plan.reuse, plan.save_to) == (0, 1, 4, None)
    # the whole prompt cached: one token is left to prefill
    plan = cache.plan(ids(1, 2, 9), free=[2, 3], lengths=lengths)
    assert (plan.row, plan.source, plan.reuse, plan.save_to) == (2, 2, 2, None)
    assert cache.stats()["prefix_cache_hits"] == 2
    assert cache.stats()["prefix_cache_saved_tokens"] == 6


def test_plan_moves_the_rows_cache_to_an_empty_row_then_to_the_lru_row():
    cache = PrefixCache(3)
    lengths = np.array([4, 0, 0])
    cache.set(0, ids(1, 2, 3, 4))
    plan = cache.plan(ids(1, 7, 7), free=[0, 1, 2], lengths=lengths)
    assert (plan.row, plan.reuse, plan.save_to) == (0, 1, 1)  # keeps 1 2 3 4 in row 1
    assert cache.ids[1].tolist() == [1, 2, 3, 4]
    lengths = np.array([3, 4, 0])
    cache.set(0, ids(1, 7, 7))
    plan = cache.plan(ids(1, 2, 3, 4, 5), free=[0, 1, 2], lengths=lengths)
    assert (plan.row, plan.source, plan.reuse, plan.save_to) == (0, 1, 4, 2)


def test_disabled_cache_always_prefills_everything():
    cache = PrefixCache(2, enabled=False)
    cache.set(0, ids(1, 2, 3))
    plan = cache.plan(ids(1, 2, 3, 4), free=[0, 1], lengths=np.array([3, 0]))
    assert (plan.row, plan.reuse, plan.save_to) == (0, 0, None)


def test_plan_does_not_save_a_cache_another_row_already_holds():
    cache = PrefixCache(3)
    cache.set(0, ids(1, 2, 3, 4))
    cache.set(1, ids(1, 2, 3, 4, 5))
    plan = cache.plan(ids(1, 9), free=[0, 1, 2], lengths=np.array([4, 5, 0]))
    assert (plan.row, plan.reuse, plan.save_to) == (0, 1, None)


def test_a_cache_too_long_to_copy_while_rows_decode_is_dropped():
    """While rows decode the engine bounds the copy that keeps a cached prefix (`max_save`):
    past it the prompt takes the lowest row as always and that row's cache is dropped, unless
    a free row's committed pages take the copy."""
    cache = PrefixCache(4)
    cache.set(0, ids(1, 2, 3, 4, 5, 6))
    lengths = np.array([6, 0, 0, 0])
    plan = cache.plan(ids(9, 9), free=[0, 1, 2], lengths=lengths, max_save=4)
    assert (plan.row, plan.reuse, plan.save_to) == (0, 0, None)
    assert cache.plan(ids(9, 9), free=[0, 1, 2], lengths=lengths, max_save=6).save_to == 1
    # a free row whose pages are committed takes the copy at no fault cost: the cache is kept
    cache = PrefixCache(4)
    cache.set(0, ids(1, 2, 3, 4, 5, 6))
    committed = np.array([6, 0, 8, 0])
    plan = cache.plan(ids(9, 9), [0, 1, 2], lengths, max_save=4, committed=committed)
    assert (plan.row, plan.save_to) == (0, 2)
    # a prefix the prompt reuses is copied whatever its length: it saves the prefill
    cache.set(2, ids(1, 2, 3, 4, 5, 6))
    lengths = np.array([0, 0, 6, 0])
    plan = cache.plan(ids(1, 2, 3, 4, 5, 6, 7), free=[0, 1, 2, 3], lengths=lengths, max_save=4)
    assert (plan.row, plan.source, plan.reuse) == (0, 2, 6)
