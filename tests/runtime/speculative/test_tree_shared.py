"""Tree speculative decoding on the shared (in-place) KV layout: the guarantees it has on concat.

Greedy output equals plain greedy token for token; an accepted path taken from the middle of
the tree is moved into place inside the bound buffer, which then holds what a fresh prefill of
the output holds; plain (batched, ragged) decoding on a tree artifact is the plain artifact's.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import specport
from specport.errors import InputError
from specport.runtime.kv.cache import SharedKVCache
from specport.runtime.kv.seq_cache import open_cache
from specport.runtime.sampler import SamplingConfig
from specport.runtime.speculative.tree import generate_tree
from specport.runtime.speculative.tree_generator import TreeSpeculativeGenerator

pytestmark = pytest.mark.slow  # exports two tiny shared artifacts (~30 s)


@pytest.fixture(scope="module")
def models(tiny_zoo: Any) -> tuple[Any, Any]:
    plain = specport.load(tiny_zoo.shared("llama"), provider="cpu", threads=1)
    tree = specport.load(tiny_zoo.shared("llama", tree_mask=True), provider="cpu", threads=1)
    return plain, tree


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        base = rng.integers(3, 256, size=int(rng.integers(1, 10))).tolist()
        out.append(base * (1 + i % 4))  # copy-heavy: the prompt repeats itself
    return out


@pytest.mark.parametrize("k,width", [(1, 1), (4, 2), (6, 4)])
def test_greedy_equals_plain(models, k, width):
    plain, tree = models
    for ids in _prompts(10):
        want = plain.generate(prompt_ids=ids, max_new_tokens=32, ignore_eos=True).tokens
        toks, reason, metrics = generate_tree(tree, ids, 32, k, width)
        assert toks == want, (k, width, ids)
        assert reason == "length" and metrics["kv_layout"] == "shared"
        spec = metrics["speculative"]
        assert spec["method"] == "ngram-tree" and 1.0 <= spec["mean_accepted_length"] <= k + 1


def test_oracle_branches_move_the_path_into_place(models):
    """The true continuation sits in a non-first branch: every accepted path is moved from the
    middle of the tree, and the buffer must equal a plain prefill of the output."""
    plain, tree = models
    rng = np.random.default_rng(3)
    gen: TreeSpeculativeGenerator | None = None
    for ids in _prompts(6, seed=5):
        want = plain.generate(prompt_ids=ids, max_new_tokens=30, ignore_eos=True).tokens
        full = ids + want

        def oracle(ctx, depth, width, full=full):
            true = full[len(ctx) : len(ctx) + depth]
            noise = [rng.integers(3, 256, size=depth).tolist() for _ in range(width - 1)]
            wrong = true[:1] + noise[0][1:]  # shares the first token, then diverges
            return [noise[1], wrong, true, *noise[2:]]

        if gen is None:
            gen = TreeSpeculativeGenerator(tree.session, tree.manifest, 4, 4, candidates=oracle)
        gen.candidates = oracle  # the same generator: its bound buffers are reused
        out = gen.generate(ids, 30)
        assert out.tokens == want
        assert out.metrics["speculative"]["mean_accepted_length"] > 3.5
        cache = gen.last_kv  # the one step's KV interface, a batch of one (engine.driver)
        assert isinstance(cache, SharedKVCache)  # its row is freed; the buffer keeps the KV
        ref = open_cache(plain.session, plain.manifest, 64)
        ref.step(full[:-1], last_only=True)
        n = len(full) - 1
        for got, exp in zip(cache.buffers, ref.bound.kv.buffers):
            np.testing.assert_allclose(got[:, :, :n], exp[:, :, :n], atol=1e-5)


def test_penalty_eos_stop_and_sampling(models):
    plain, tree = models
    ids = [5, 6, 7, 5, 6, 7, 5, 6]
    want = plain.generate(
        prompt_ids=ids, max_new_tokens=20, ignore_eos=True, repetition_penalty=1.3
    ).tokens
    toks, _, _ = generate_tree(tree, ids, 20, 4, 3, SamplingConfig(repetition_penalty=1.3))
    assert toks == want
    plain_want = plain.generate(prompt_ids=ids, max_new_tokens=20, ignore_eos=True).tokens
    toks, reason, _ = generate_tree(tree, ids, 20, 4, 3, eos_ids=[plain_want[2]])
    assert reason == "eos" and toks == plain_want[: plain_want.index(plain_want[2]) + 1]
    toks, reason, _ = generate_tree(tree, ids, 20, 4, 3, on_token=lambda t: True)
    assert reason == "stop" and len(toks) == 1
    cfg = SamplingConfig(greedy=False, temperature=0.8, seed=7)
    a = generate_tree(tree, ids, 20, 4, 3, cfg)[0]
    assert a == generate_tree(tree, ids, 20, 4, 3, cfg)[0]  # seeded: reproducible
    assert len(a) == 20 and all(0 <= t < tree.manifest.vocab_size for t in a)


def test_near_the_buffer_end_the_tree_shrinks_to_fit(models):
    """A tree's nodes take slots past the output: close to the limit it is cut to the room."""
    plain, tree = models
    limit = tree.manifest.kv.max_length
    ids = (_prompts(4)[3] * 40)[: limit - 6]
    want = plain.generate(prompt_ids=ids, max_new_tokens=6, ignore_eos=True).tokens
    gen = TreeSpeculativeGenerator(tree.session, tree.manifest, 6, 4)
    assert gen.generate(ids, 6).tokens == want


def test_api_plain_and_batched_decoding_on_a_tree_artifact(models):
    plain, tree = models
    prompt = [1, 5, 9, 5, 9, 5, 9, 5]
    want = plain.generate(prompt_ids=prompt, max_new_tokens=16, ignore_eos=True).tokens
    got = tree.generate(
        prompt_ids=prompt, max_new_tokens=16, ignore_eos=True, speculative="ngram", tree_width=3
    )
    assert got.tokens == want and got.metrics["speculative"]["method"] == "ngram-tree"
    chain = tree.generate(
        prompt_ids=prompt, max_new_tokens=16, ignore_eos=True, speculative="ngram"
    )
    assert chain.tokens == want
    rows = _prompts(4, seed=9)  # ragged rows: the causal tree mask must not disturb them
    a = plain.generate_batch(prompt_ids=rows, max_new_tokens=12, ignore_eos=True)
    b = tree.generate_batch(prompt_ids=rows, max_new_tokens=12, ignore_eos=True)
    assert [r.tokens for r in a] == [r.tokens for r in b]


def test_bad_input(models):
    plain, tree = models
    with pytest.raises(InputError, match="--tree-mask"):
        generate_tree(plain, [1, 2, 3], 5, 4, 2)
    cache = open_cache(plain.session, plain.manifest, 16)
    with pytest.raises(InputError, match="--tree-mask"):
        cache.step([1, 2], tree=(np.array([0, 1]), np.tri(2, dtype=np.int64)))
    with pytest.raises(InputError, match="--tree-width"):
        generate_tree(tree, [1, 2, 3], 5, 4, 0)


@pytest.mark.parametrize("speculative", [None, "ngram"])
def test_batching_engine_on_a_tree_artifact(models, speculative):
    """Chunked prefill, prefix-cache hits and engine speculation feed the causal mask."""
    import time

    from specport.runtime.engine.base import Request
    from specport.runtime.engine.batching import BatchingEngine

    plain, tree = models
    rng = np.random.default_rng(4)
    system = [1, *rng.integers(3, 250, 12).tolist()]
    prompts = [(system if i % 2 else [1]) + _prompts(10, seed=i)[i % 10] for i in range(10)]
    news = rng.integers(4, 30, len(prompts)).tolist()
    want = [
        plain.generate(prompt_ids=p, max_new_tokens=n, ignore_eos=True).tokens
        for p, n in zip(prompts, news)
    ]
    eng = BatchingEngine(tree, max_batch=3, prefill_chunk=5, speculative=speculative)
    try:
        handles = []
        for p, n in zip(prompts, news):
            handles.append(eng.submit(Request(p, n, ignore_eos=True)))
            time.sleep(float(rng.uniform(0, 0.004)))
        assert [h.result(timeout=60).token_ids for h in handles] == want
        assert eng.stats()["prefix_cache_hits"] > 0
    finally:
        eng.close()
