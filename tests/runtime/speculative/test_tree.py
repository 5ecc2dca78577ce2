"""Tree speculative decoding: trie, n-gram candidates, verification, and plain-greedy equality."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from specport.contract import prefill_feeds
from specport.errors import InputError
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
    import specport

    return specport.load(tiny_zoo.artifact("llama")), specport.load(_tree_artifact(tiny_zoo))


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        base = rng.integers(3, 256, size=int(rng.integers(1, 10))).tolist()
        out.append(base * (1 + i % 4))  # copy-heavy: the prompt repeats itself
    return out


@pytest.mark.slow
@pytest.mark.parametrize("k,width", [(1, 1), (4, 2), (6, 4)])
def test_greedy_equals_plain_tiny(tiny, k, width):
    plain, tree = tiny
    for ids in _prompts(10):
        want = plain.generate(prompt_ids=ids, max_new_tokens=24, ignore_eos=True).tokens
        toks, reason, metrics = generate_tree(tree, ids, 24, k, width)
        assert toks == want, (k, width, ids)
        assert reason == "length"
        spec = metrics["speculative"]
        assert spec["method"] == "ngram-tree" and spec["tree_width"] == width
        assert 1.0 <= spec["mean_accepted_length"] <= k + 1
        for key in ("decode_tok_per_s", "ttft_ms", "decode_steps", "propose_s", "provider"):
            assert key in metrics


@pytest.mark.slow
def test_oracle_branches_accept_and_keep_exact_kv(tiny, monkeypatch):
    """Candidates hold the true continuation in a non-first branch: accepted paths are gathered
    from the middle of the tree, and the cache must equal a plain prefill of the output."""
    from tests.runtime.speculative.test_loop import kept_kv

    plain, tree_model = tiny
    kept = kept_kv(monkeypatch)
    rng = np.random.default_rng(3)
    for ids in _prompts(6, seed=5):
        want = plain.generate(prompt_ids=ids, max_new_tokens=30, ignore_eos=True).tokens
        full = ids + want

        def oracle(ctx, depth, width, full=full):
            true = full[len(ctx) : len(ctx) + depth]
            noise = [rng.integers(3, 256, size=depth).tolist() for _ in range(width - 1)]
            wrong = true[:1] + noise[0][1:]  # shares the first token, then diverges
            return [noise[1], wrong, true, *noise[2:]]

        gen = TreeSpeculativeGenerator(
            tree_model.session, tree_model.manifest, 4, 4, candidates=oracle
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
def test_penalty_eos_and_sampling(tiny):
    plain, tree = tiny
    ids = [5, 6, 7, 5, 6, 7, 5, 6]
    want = plain.generate(
        prompt_ids=ids, max_new_tokens=20, ignore_eos=True, repetition_penalty=1.3
    ).tokens
    toks, _, _ = generate_tree(tree, ids, 20, 4, 3, SamplingConfig(repetition_penalty=1.3))
    assert toks == want
    toks, reason, _ = generate_tree(tree, ids, 20, 4, 3, eos_ids=[want[2]])
    assert reason == "eos" and toks == want[: want.index(want[2]) + 1]
    toks, reason, _ = generate_tree(tree, ids, 20, 4, 3, on_token=lambda t: True)
    assert reason == "stop" and len(toks) == 1
    cfg = SamplingConfig(greedy=False, temperature=0.8, seed=7)
    a = generate_tree(tree, ids, 20, 4, 3, cfg)[0]
    assert a == generate_tree(tree, ids, 20, 4, 3, cfg)[0]  # seeded: reproducible
    assert len(a) == 20 and all(0 <= t < tree.manifest.vocab_size for t in a)


@pytest.mark.slow
def test_bad_input(tiny):
    plain, tree = tiny
    with pytest.raises(InputError, match="--tree-mask"):
        generate_tree(plain, [1, 2, 3], 5, 4, 2)
    with pytest.raises(InputError, match="--tree-width"):
        generate_tree(tree, [1, 2, 3], 5, 4, 0)
    with pytest.raises(InputError, match="--num-draft"):
        generate_tree(tree, [1, 2, 3], 5, 0, 2)
    with pytest.raises(InputError, match="at least one token"):
        generate_tree(tree, [], 5, 4, 2)
    with pytest.raises(InputError, match="outside the vocabulary"):
        generate_tree(tree, [10**6], 5, 4, 2)


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


@pytest.mark.slow
def test_api_and_bench_run_tree_width(tiny):
    from specport.bench.speculative import SpecBenchConfig, _run

    plain, tree = tiny
    prompt = [1, 5, 9, 5, 9, 5, 9, 5]
    want = plain.generate(prompt_ids=prompt, max_new_tokens=16, ignore_eos=True).tokens
    got = tree.generate(
        prompt_ids=prompt, max_new_tokens=16, ignore_eos=True, speculative="ngram", tree_width=3
    )
    assert got.tokens == want
    assert got.metrics["speculative"]["method"] == "ngram-tree"
    config = SpecBenchConfig(
        methods=[], prompt_ids=[prompt], max_new_tokens=16, runs=1, tree_widths=[2]
    )
    report = _run(tree, tree, "tiny", config)
    assert [r["engine"] for r in report["rows"]] == ["plain", "ngram-tree2"]
    assert all(r["tokens_equal_plain"] for r in report["rows"])
