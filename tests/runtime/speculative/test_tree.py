"""Tree speculative decoding: trie, n-gram candidates, verification, and on real artifacts in
both KV layouts (concat and shared) greedy output equal to plain greedy token for token, the
accepted path's KV equal to a plain prefill of the output, and plain (batched, ragged) decoding
on a tree artifact equal to the plain artifact's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from specport.core.contract import prefill_feeds
from specport.core.errors import InputError
from specport.runtime.sampler import Sampler, SamplingConfig
from specport.runtime.speculative.ngram import NgramProposer
from specport.runtime.speculative.token_tree import TokenTree, ngram_candidates
from specport.runtime.speculative.tree import generate_tree
from specport.runtime.speculative.tree_generator import TreeSpeculativeGenerator, check_tree_width
from specport.runtime.speculative.verify import make_verifier

# ---------------------------------------------------------------------- fast: pure numpy


def _verify(tree, logits, sampler, context):
    """The tree verdict of the verifier the sampler's settings choose."""
    return make_verifier(sampler).tree(tree, logits, context)


def test_token_tree_merges_prefixes_and_flattens():
    tree = TokenTree(root=9, max_nodes=16)
    assert tree.add([1, 2, 3]) == 3
    assert tree.add([1, 2, 4]) == 1  # shares 1, 2
    assert tree.add([5]) == 1
    assert tree.add([1, 2]) == 0
    tokens, depths, mask = tree.flatten()
    assert tokens.tolist() == [9, 1, 2, 3, 4, 5]
    assert depths.tolist() == [0, 1, 2, 3, 3, 1]
    assert mask.tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 0, 1, 0],
        [1, 0, 0, 0, 0, 1],
    ]
    assert tree.path_to(4) == [0, 1, 2, 4] and tree.max_depth == 3


def test_token_tree_cap():
    tree = TokenTree(root=0, max_nodes=4)
    assert tree.add([1, 2, 3, 4, 5]) == 3  # kept as far as it fits
    assert tree.add([7]) == 0
    assert len(tree) == 4
    with pytest.raises(InputError):
        TokenTree(root=0, max_nodes=0)


def test_ngram_candidates_order_and_distinct():
    #        0  1  2  3  4  5  6  7  8  9 10 11
    ctx = [1, 2, 3, 9, 1, 2, 4, 8, 5, 2, 6, 1, 2]
    # suffix [1, 2] ends at 1 and 5 (3 continues, then 4); suffix [2] also ends at 9
    got = ngram_candidates(ctx, 2, 8)
    assert got[0] == [4, 8] and got[1] == [3, 9] and got[2] == [6, 1]
    assert len(got) == len({tuple(c) for c in got}) == 3
    assert ngram_candidates(ctx, 2, 1) == [[4, 8]]
    # the first candidate is the chain proposer's draft
    for seed in range(20):
        rng = np.random.default_rng(seed)
        row = rng.integers(0, 5, size=30).tolist()
        chain = NgramProposer(max_draft=6).propose_one(row, 6)
        cands = ngram_candidates(row, 6, 4)
        assert (cands[0] if cands else []) == chain


def test_ngram_candidates_periodic_and_empty():
    assert ngram_candidates([7, 7, 7], 5, 3) == [[7, 7, 7, 7, 7]]
    assert ngram_candidates([1, 2, 1, 2], 5, 3)[0] == [1, 2, 1, 2, 1]
    assert ngram_candidates([1, 2, 3], 3, 4) == []
    assert ngram_candidates([5], 3, 4) == []
    assert ngram_candidates([1, 1], 0, 4) == []


@pytest.mark.parametrize("bad", [0, 17, 2.0, True, "3"])
def test_check_tree_width(bad):
    with pytest.raises(InputError, match="--tree-width"):
        check_tree_width(bad)


def _toy_tree() -> tuple[TokenTree, np.ndarray]:
    tree = TokenTree(root=0, max_nodes=8)
    tree.add([1, 2])  # nodes 1, 2
    tree.add([3, 4])  # nodes 3, 4
    logits = np.zeros((5, 6), np.float32)
    return tree, logits


def test_greedy_verify_takes_second_branch():
    tree, logits = _toy_tree()
    logits[0, 3] = 5  # root -> 3 (second branch)
    logits[3, 4] = 5  # 3 -> 4
    logits[4, 5] = 5  # bonus after 4
    path, extra = _verify(tree, logits, Sampler(SamplingConfig(), 6), [0])
    assert path == [0, 3, 4] and extra == 5
    logits[3, 4], logits[3, 1] = 0, 5  # 3 -> 1: not a child of 3
    path, extra = _verify(tree, logits, Sampler(SamplingConfig(), 6), [0])
    assert path == [0, 3] and extra == 1
    # a repetition penalty that flips the root's argmax
    logits[0, 0] = 4.9
    sampler = Sampler(SamplingConfig(repetition_penalty=2.0), 6)
    path, extra = _verify(tree, logits, sampler, [3])
    assert path == [0] and extra == 0


def test_tree_rejection_sampling_is_lossless():
    """The first emitted token follows p at the root, whatever the candidates are."""
    tree, logits = _toy_tree()
    p = np.array([0.1, 0.3, 0.05, 0.4, 0.05, 0.1])
    logits[0] = np.log(p)
    sampler = Sampler(SamplingConfig(greedy=False, seed=0), 6)
    n = 20000
    counts = np.zeros(6)
    for _ in range(n):
        path, extra = _verify(tree, logits, sampler, [0])
        counts[tree.tokens[path[1]] if len(path) > 1 else extra] += 1
    np.testing.assert_allclose(counts / n, p, atol=0.012)


def test_keep_path_cuts_a_chain_and_gathers_a_branch():
    class Cache:
        calls: list[tuple[str, list[int]]] = []

        def keep(self, row, n):
            self.calls.append(("keep", [n]))

        def keep_positions(self, row, index):
            self.calls.append(("positions", np.asarray(index).tolist()))

    from specport.runtime.engine.step import keep_path

    cache = Cache()
    keep_path(cache, 0, 4, [0, 3, 4])  # type: ignore[arg-type]
    keep_path(cache, 0, 4, [0, 1])  # type: ignore[arg-type]
    assert cache.calls == [("positions", [0, 1, 2, 3, 4, 7, 8]), ("keep", [6])]


# ---------------------------------------------------------------------- slow: real artifacts
# The tiny Llama and its --tree-mask export in both KV layouts: concat (present = past + new,
# accepted paths gathered by the cache) and shared (one bound buffer per layer, accepted paths
# moved into place inside it). Every guarantee holds on both.

LAYOUTS = ("concat", "shared")


def _tree_artifact(zoo: Any) -> Path:
    """The tiny Llama exported with --tree-mask (shared with tests/exporter/test_tree_mask.py)."""
    from specport.exporter.export import export_model

    cache = zoo.__dict__.setdefault("tree_artifacts", {})
    if False not in cache:
        out = zoo.root / "art" / "llama-tree-plain"
        export_model(zoo.source("llama"), out, fuse=False, tree_mask=True, progress=False)
        cache[False] = out
    return cache[False]


@pytest.fixture(scope="module")
def tiny(tiny_zoo):
    """(plain, tree-mask) tiny Llama artifacts in the concat layout."""
    import specport

    return specport.load(tiny_zoo.artifact("llama")), specport.load(_tree_artifact(tiny_zoo))


@pytest.fixture(scope="module")
def tiny_shared(tiny_zoo):
    """(plain, tree-mask) tiny Llama artifacts in the shared layout."""
    import specport

    plain = specport.load(tiny_zoo.shared("llama"), provider="cpu", threads=1)
    tree = specport.load(tiny_zoo.shared("llama", tree_mask=True), provider="cpu", threads=1)
    return plain, tree


@pytest.fixture(params=LAYOUTS)
def models(request):
    """(plain, tree-mask) artifacts, once per KV layout."""
    return request.getfixturevalue("tiny" if request.param == "concat" else "tiny_shared")


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        base = rng.integers(3, 256, size=int(rng.integers(1, 10))).tolist()
        out.append(base * (1 + i % 4))  # copy-heavy: the prompt repeats itself
    return out


def _oracle(full: list[int], rng: np.random.Generator):
    """Candidates with the true continuation of `full` in a non-first branch (after a branch
    that shares its first token, then diverges): every accepted path is taken from the
    middle of the tree."""

    def candidates(ctx, depth, width):
        true = full[len(ctx) : len(ctx) + depth]
        noise = [rng.integers(3, 256, size=depth).tolist() for _ in range(width - 1)]
        wrong = true[:1] + noise[0][1:]
        return [noise[1], wrong, true, *noise[2:]]

    return candidates


@pytest.mark.slow
@pytest.mark.parametrize("k,width", [(1, 1), (4, 2), (6, 4)])
def test_greedy_equals_plain(models, k, width):
    plain, tree = models
    for ids in _prompts(10):
        want = plain.generate(prompt_ids=ids, max_new_tokens=32, ignore_eos=True).tokens
        toks, reason, metrics = generate_tree(tree, ids, 32, k, width)
        assert toks == want, (k, width, ids)
        assert reason == "length" and metrics["kv_layout"] == tree.manifest.kv.layout
        spec = metrics["speculative"]
        assert spec["method"] == "ngram-tree" and spec["tree_width"] == width
        assert 1.0 <= spec["mean_accepted_length"] <= k + 1
        for key in ("decode_tok_per_s", "ttft_ms", "decode_steps", "propose_s", "provider"):
            assert key in metrics


@pytest.mark.slow
def test_oracle_branches_gather_the_path_and_keep_exact_kv(tiny, monkeypatch):
    """Concat: accepted paths are gathered from the middle of the tree, and the cache must
    equal a plain prefill of the output."""
    from tests.runtime.speculative.test_loop import kept_kv

    plain, tree_model = tiny
    kept = kept_kv(monkeypatch)
    rng = np.random.default_rng(3)
    for ids in _prompts(6, seed=5):
        want = plain.generate(prompt_ids=ids, max_new_tokens=30, ignore_eos=True).tokens
        full = ids + want
        gen = TreeSpeculativeGenerator(
            tree_model.session, tree_model.manifest, 4, 4, candidates=_oracle(full, rng)
        )
        out = gen.generate(ids, 30)
        assert out.tokens == want
        assert out.metrics["speculative"]["mean_accepted_length"] > 3.5
        sess = plain.session
        ref = sess.run(None, prefill_feeds(sess, np.asarray(full[:-1], np.int64)))[1:]
        assert kept["kv"][0].shape[2] == len(full) - 1
        for got, exp in zip(kept["kv"], ref):
            np.testing.assert_allclose(got, exp, atol=1e-5)


@pytest.mark.slow
def test_oracle_branches_move_the_path_into_place(tiny_shared):
    """Shared: every accepted path is moved from the middle of the tree inside the bound
    buffer, which must then equal a plain prefill of the output."""
    from specport.runtime.kv.cache import SharedKVCache
    from specport.runtime.kv.seq_cache import open_cache

    plain, tree = tiny_shared
    rng = np.random.default_rng(3)
    gen: TreeSpeculativeGenerator | None = None
    for ids in _prompts(6, seed=5):
        want = plain.generate(prompt_ids=ids, max_new_tokens=30, ignore_eos=True).tokens
        full = ids + want
        if gen is None:
            gen = TreeSpeculativeGenerator(tree.session, tree.manifest, 4, 4)
        gen.candidates = _oracle(full, rng)  # the same generator: its bound buffers are reused
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_near_the_buffer_end_the_tree_shrinks_to_fit(tiny_shared):
    """A tree's nodes take slots past the output: close to the limit it is cut to the room."""
    plain, tree = tiny_shared
    limit = tree.manifest.kv.max_length
    ids = (_prompts(4)[3] * 40)[: limit - 6]
    want = plain.generate(prompt_ids=ids, max_new_tokens=6, ignore_eos=True).tokens
    gen = TreeSpeculativeGenerator(tree.session, tree.manifest, 6, 4)
    assert gen.generate(ids, 6).tokens == want


@pytest.mark.slow
def test_bad_input(models):
    from specport.runtime.kv.seq_cache import open_cache

    plain, tree = models
    with pytest.raises(InputError, match="--tree-mask"):
        generate_tree(plain, [1, 2, 3], 5, 4, 2)
    cache = open_cache(plain.session, plain.manifest, 16)
    with pytest.raises(InputError, match="--tree-mask"):
        cache.step([1, 2], tree=(np.array([0, 1]), np.tri(2, dtype=np.int64)))
    with pytest.raises(InputError, match="--tree-width"):
        generate_tree(tree, [1, 2, 3], 5, 4, 0)
    with pytest.raises(InputError, match="--num-draft"):
        generate_tree(tree, [1, 2, 3], 5, 0, 2)
    with pytest.raises(InputError, match="at least one token"):
        generate_tree(tree, [], 5, 4, 2)
    with pytest.raises(InputError, match="outside the vocabulary"):
        generate_tree(tree, [10**6], 5, 4, 2)


@pytest.mark.slow
def test_api_bench_and_batched_decoding_on_a_tree_artifact(models):
    """generate(tree_width=) and its chain, `bench --tree-width`, and plain ragged batches on a
    tree artifact (the causal tree mask must not disturb them) give plain greedy's tokens."""
    from specport.bench.speculative import SpecBenchConfig, _run

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
    config = SpecBenchConfig(
        methods=[], prompt_ids=[prompt], max_new_tokens=16, runs=1, tree_widths=[2]
    )
    report = _run(tree, tree, "tiny", config)
    assert [r["engine"] for r in report["rows"]] == ["plain", "ngram-tree2"]
    assert all(r["tokens_equal_plain"] for r in report["rows"])
    rows = _prompts(4, seed=9)
    a = plain.generate_batch(prompt_ids=rows, max_new_tokens=12, ignore_eos=True)
    b = tree.generate_batch(prompt_ids=rows, max_new_tokens=12, ignore_eos=True)
    assert [r.tokens for r in a] == [r.tokens for r in b]


@pytest.mark.slow
@pytest.mark.parametrize("speculative", [None, "ngram"])
def test_batching_engine_on_a_tree_artifact(tiny_shared, speculative):
    """Chunked prefill, prefix-cache hits and engine speculation feed the causal mask (the
    batching engine runs the shared layout)."""
    import time

    from specport.runtime.engine.base import Request
    from specport.runtime.engine.batching import BatchingEngine

    plain, tree = tiny_shared
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


@pytest.fixture(scope="module")
def stories(shared_path, tmp_path_factory):
    import specport
    from specport.exporter.export import export_model

    src = shared_path("models", "stories260K")
    out = tmp_path_factory.mktemp("tree_stories") / "tree"
    export_model(src, out, fuse=False, tree_mask=True, progress=False)
    return specport.load(out)


@pytest.mark.slow
def test_stories260k_greedy_equal_and_tree_accepts_more(stories):
    from specport.bench.prompt_sets import PROMPT_SETS
    from specport.runtime.speculative.loop import generate_speculative

    tree = stories  # plain greedy on it runs a causal tree_mask (equal to a plain export:
    # tests/exporter/test_tree_mask.py), which saves a second export here
    tree_acc = chain_acc = 0.0
    for text in PROMPT_SETS["copy"] + PROMPT_SETS["story"]:
        ids = tree.encode(text)
        want = tree.generate(prompt_ids=ids, max_new_tokens=48, ignore_eos=True).tokens
        for width in (1, 3):
            toks, _, m = generate_tree(tree, ids, 48, 4, width)
            assert toks == want, (text, width)
        if text in PROMPT_SETS["copy"]:
            _, _, mc = generate_speculative(tree, ids, 48, "ngram", 4)
            chain_acc += mc["speculative"]["mean_accepted_length"]
            tree_acc += m["speculative"]["mean_accepted_length"]
    assert tree_acc >= chain_acc > len(PROMPT_SETS["copy"])  # n-gram drafting pays at all
