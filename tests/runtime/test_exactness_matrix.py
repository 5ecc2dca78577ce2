"""One exactness matrix: layout x proposer x verifier x engine, staggered arrivals, cancellations.

What users rely on, everywhere speculation runs: greedy speculative output equals plain greedy
output token for token (with or without a repetition penalty, which the verifier applies per
draft position), and a seeded sampled run is reproducible. One tiny Llama (head_dim 16) is
exported once per layout with a tree mask, so chains, token trees, the batched generator
(concat) and the serving engine (shared) all run on the same two artifacts; MTP heads (random,
untrained: their drafts are mostly rejected, which exercises the rollback) are added to each.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from specport.runtime.sampler import Sampler, SamplingConfig
from specport.runtime.speculative.base import Drafts, ProposerBase, adopt
from specport.runtime.speculative.verify import (
    GREEDY,
    GrammarVerifier,
    ProcessedGreedyVerifier,
    RejectionVerifier,
    make_verifier,
)

LAYOUTS = ("concat", "shared")
# repeated patterns: n-gram and suffix drafts are accepted and rejected
PROMPTS = [[1, 3, 4] * 6, [1, 74, 75, 76, 90, 74, 75, 76], [1, 100], [1, 5, 6, 7, 8, 5, 6]]
NEW = 20
VERIFIERS = {"greedy": {}, "greedy-penalty": {"repetition_penalty": 1.3}}


# ---------------------------------------------------------------- fast: the verifier choice


def test_verifier_is_chosen_once_from_the_settings():
    vocab = 8
    assert make_verifier(None) is GREEDY
    assert make_verifier(Sampler(SamplingConfig(), vocab)) is GREEDY
    penalized = Sampler(SamplingConfig(repetition_penalty=1.2), vocab)
    assert isinstance(make_verifier(penalized), ProcessedGreedyVerifier)
    sampled = Sampler(SamplingConfig(greedy=False, seed=1), vocab)
    assert isinstance(make_verifier(sampled), RejectionVerifier)


def test_grammar_verifier_refuses_trees_and_batches():
    class _Grammar:
        def mask(self, scores):
            return scores

        def accept(self, token):
            return None

    sampler = Sampler(SamplingConfig(constraint=_Grammar()), 4)
    verifier = make_verifier(sampler)
    assert isinstance(verifier, GrammarVerifier)
    from specport.core.errors import InputError

    with pytest.raises(InputError, match="one sequence"):
        verifier.chain(Drafts.from_lists([[1], [2]]), np.zeros((2, 2, 4)), ([0], [0]))


def test_partial_proposer_is_adopted_once():
    class OnlyPropose:
        name = "mine"

        def propose(self, context, num_draft):
            return Drafts.one([1] * num_draft)

    p = adopt(OnlyPropose())
    assert p.name == "mine" and not p.needs_outputs and not p.graph_verifies
    p.start(None)
    p.observe({}, None)
    assert p.propose([[0]], 2).row(0) == [1, 1]
    assert adopt(p) is p and isinstance(p, ProposerBase)


# ---------------------------------------------------------------- slow: the matrix

slow = pytest.mark.slow  # two tiny exports (~20-60 s)


@pytest.fixture(scope="module")
def arts(tmp_path_factory) -> dict[str, Any]:
    import specport
    from tests.export_cache import cached_export, cached_mtp
    from tests.fixtures import TINY, make_llama

    tmp: Path = tmp_path_factory.mktemp("exactness")
    hf = make_llama(tmp / "hf", context_length=128, initializer_range=0.2, **TINY)  # type: ignore[arg-type]
    out: dict[str, Any] = {}
    for layout in LAYOUTS:
        cached_export(
            hf, tmp / layout, kv_layout=layout, tree_mask=True, skip_verify=True, progress=False
        )
        out[layout] = specport.load(tmp / layout, threads=1)
        cached_mtp(tmp / layout, tmp / f"mtp_{layout}", heads=2, seed=0)
        out[f"mtp_{layout}"] = specport.load(tmp / f"mtp_{layout}", threads=1, mtp_branch=True)
    return out


def _plain(model: Any, verifier: str) -> list[list[int]]:
    kw = VERIFIERS[verifier]
    return [
        model.generate(prompt_ids=p, max_new_tokens=NEW, ignore_eos=True, **kw).tokens
        for p in PROMPTS
    ]


@slow
@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed-k", "adaptive"])
@pytest.mark.parametrize("verifier", list(VERIFIERS))
@pytest.mark.parametrize(
    "proposer", ["ngram", "suffix", "mtp", "ngram-tree", "auto", "auto-mtp"]
)  # auto: the hybrid (suffix alone on the base artifact, suffix + MTP heads on mtp_*)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_batch1_loops_equal_plain(arts, layout, proposer, verifier, adaptive):
    """One prompt: on shared the one step driven as a batch of one (chains, the MTP graph's
    own verdict under greedy, token trees through the tree mask); on concat its loops."""
    if proposer == "ngram-tree" and adaptive:
        pytest.skip("token trees have a fixed depth")
    base = arts[layout]
    model = arts[f"mtp_{layout}"] if proposer in ("mtp", "auto-mtp") else base
    want = _plain(base, verifier)
    method = {"ngram-tree": "ngram", "auto-mtp": "auto"}.get(proposer, proposer)
    width = 3 if proposer == "ngram-tree" else 1
    for p, ref in zip(PROMPTS, want):
        got = model.generate(
            prompt_ids=p,
            max_new_tokens=NEW,
            ignore_eos=True,
            speculative=method,
            num_draft=2,
            tree_width=width,
            adaptive=adaptive,
            **VERIFIERS[verifier],
        )
        assert got.tokens == ref, (layout, proposer, verifier, p)
        spec = got.metrics["speculative"]
        assert spec["steps"] >= 1 and got.metrics["step_overhead_ms"] is not None
        assert spec["adaptive"] is adaptive or width > 1
        if width > 1:
            assert spec["tree_width"] == width and spec["tree_nodes"] >= spec["drafted"]


@slow
@pytest.mark.parametrize("proposer", ["ngram", "suffix", "mtp", "auto", "ngram-tree"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_chat_turns_reuse_the_kv_and_equal_plain(arts, layout, proposer):
    """A chat's next turn (the last prompt + its answer + a new message) prefills only what
    follows the KV kept from the last call, on the shared layout, for chains and token trees;
    every turn equals plain greedy on its whole prompt. A call that did not finish leaves
    nothing to reuse."""
    base = arts[layout]
    model = arts[f"mtp_{layout}"] if proposer == "mtp" else base
    kw: dict[str, Any] = dict(max_new_tokens=NEW, ignore_eos=True, num_draft=2)
    plain_kw = dict(kw)
    if proposer == "ngram-tree":
        proposer = "ngram"
        kw["tree_width"] = 3
    prompt = list(PROMPTS[0])
    for turn in range(3):
        got = model.generate(prompt_ids=prompt, speculative=proposer, **kw)
        assert got.tokens == base.generate(prompt_ids=prompt, **plain_kw).tokens, (turn, proposer)
        cached = got.metrics["cached_prompt_tokens"]
        if layout == "concat":
            assert cached == 0
        elif turn:  # (the first turn may continue an earlier test's call)
            assert cached >= len(prompt) - 5  # all but the new message (and the last token)
        prompt = [*prompt, *got.tokens, 1, 5, 6, 7]
    model.generate(prompt_ids=prompt, speculative=proposer, **kw)
    again = model.generate(prompt_ids=prompt, speculative=proposer, **kw)  # the same prompt
    assert again.metrics["cached_prompt_tokens"] == (len(prompt) - 1) * (layout == "shared")

    def stop(text: str) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        model.generate(prompt_ids=prompt, speculative=proposer, on_text=stop, **kw)
    after = model.generate(prompt_ids=prompt, speculative=proposer, **kw)
    assert after.metrics["cached_prompt_tokens"] == 0
    assert after.tokens == again.tokens


@slow
@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed-k", "adaptive"])
@pytest.mark.parametrize("verifier", list(VERIFIERS))
@pytest.mark.parametrize("proposer", ["ngram", "suffix", "mtp", "auto"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_batched_generator_equals_plain(arts, layout, proposer, verifier, adaptive):
    """Several prompts in one speculative batch: the one step driven synchronously
    (`engine.driver`) on the layout's KV cache (`kv.cache.open_kv_cache`)."""
    model = arts[f"mtp_{layout}"] if proposer == "mtp" else arts[layout]
    want = _plain(arts[layout], verifier)
    got = model.generate_batch(
        prompt_ids=PROMPTS,
        max_new_tokens=NEW,
        ignore_eos=True,
        speculative=proposer,
        num_draft=2,
        adaptive=adaptive,
        **VERIFIERS[verifier],
    )
    assert [g.tokens for g in got] == want, (layout, proposer, verifier)
    assert [g.finish_reason for g in got] == ["length"] * len(PROMPTS)
    assert got[0].metrics["speculative"]["steps"] >= 1
    assert got[0].metrics["step_overhead_ms"] is not None


@slow
@pytest.mark.parametrize("verifier", list(VERIFIERS))
@pytest.mark.parametrize("proposer", ["ngram", "suffix", "auto"])
@pytest.mark.parametrize("max_rows", [8, 1], ids=["rows-verify-alone", "compute-bound-rule"])
def test_engine_staggered_and_cancelled_equal_plain(arts, proposer, verifier, max_rows):
    """The serving engine (shared layout): arrivals while others decode, more requests than
    rows, a cancellation mid-generation; every finished request equals plain greedy."""
    from specport.runtime.engine.base import Request
    from specport.runtime.engine.batching import BatchingEngine

    model = arts["shared"]
    want = _plain(model, verifier)
    sampling = SamplingConfig(**VERIFIERS[verifier])
    eng = BatchingEngine(
        model, max_batch=2, prefill_chunk=4, speculative=proposer, spec_max_rows=max_rows
    )
    try:
        first = eng.submit(Request(PROMPTS[0], NEW, ignore_eos=True, sampling=sampling))
        events = first.events(timeout=60)
        head = next(events)  # the first request has started (its first event may hold all)
        doomed = eng.submit(Request(PROMPTS[2], 100, ignore_eos=True, sampling=sampling))
        rest = [
            eng.submit(Request(PROMPTS[i], NEW, ignore_eos=True, sampling=sampling)) for i in (1, 3)
        ]
        next(doomed.events(timeout=60))
        doomed.cancel()
        assert [t for ev in (head, *events) for t in ev.token_ids] == want[0]
        for i, handle in zip((1, 3), rest):
            assert handle.result(timeout=60).token_ids == want[i], (proposer, verifier, i)
        assert doomed.result(timeout=60).finish_reason == "cancelled"
        stats = eng.stats()
        assert stats["errors"] == 0 and stats["step_overhead_ms"] is not None
    finally:
        eng.close()


@slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_seeded_sampling_is_reproducible(arts, layout):
    """Rejection sampling draws from the request's seeded RNG: the same seed, the same text."""
    kw = dict(max_new_tokens=NEW, ignore_eos=True, greedy=False, seed=7, speculative="ngram")
    a = arts[layout].generate(prompt_ids=PROMPTS[0], **kw).tokens
    b = arts[layout].generate(prompt_ids=PROMPTS[0], **kw).tokens
    assert a == b and len(a) == NEW


@slow
@pytest.mark.parametrize("rows", [1, len(PROMPTS)], ids=["batch1", "batchN"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_step_trusts_the_mtp_graph_verdict_under_greedy(arts, layout, rows):
    """The step's verifier under plain greedy on an MTP artifact is the graph's own verdict
    (no host argmax); it gives the host verifier's tokens and acceptance, step for step."""
    from specport.runtime.engine.driver import generate_rows
    from specport.runtime.speculative.loop import make_proposer
    from specport.runtime.speculative.verify import GraphVerifier, graph_outputs

    model = arts[f"mtp_{layout}"]
    assert isinstance(make_verifier(None, graph_outputs(model.manifest)), GraphVerifier)
    want = _plain(arts[layout], "greedy")[:rows]
    runs = {}
    for in_graph in (True, False):
        out = generate_rows(
            model, PROMPTS[:rows], NEW, lambda: make_proposer("mtp", model, 2), 2,
            graph_verify=in_graph,
        )  # fmt: skip
        assert out.tokens == want, in_graph
        runs[in_graph] = out.metrics["speculative"]
    assert runs[True]["steps"] == runs[False]["steps"]
    assert runs[True]["accepted"] == runs[False]["accepted"]


@slow
def test_tree_on_shared_runs_through_the_step(arts):
    """A token tree on the shared layout is the step's tree path: drafted as ``Drafts.tree``,
    scored in one run through the tree mask, the accepted path kept with ``keep_positions``;
    the KV it leaves equals a fresh prefill of the output."""
    from specport.runtime.kv.seq_cache import open_cache
    from specport.runtime.speculative.tree_generator import TreeSpeculativeGenerator

    model = arts["shared"]
    want = _plain(model, "greedy")
    rng = np.random.default_rng(0)
    for p, ref in zip(PROMPTS, want):
        full = p + ref

        def oracle(ctx, depth, width, full=full):  # the truth in the middle branch
            true = full[len(ctx) : len(ctx) + depth]
            noise = [rng.integers(3, 250, size=depth).tolist() for _ in range(width)]
            return [noise[0], true[:1] + noise[1][1:], true, *noise[2:]]

        gen = TreeSpeculativeGenerator(model.session, model.manifest, 3, 3, candidates=oracle)
        out = gen.generate(p, NEW)
        assert out.tokens == ref
        assert out.metrics["speculative"]["mean_accepted_length"] > 2.0
        cache = gen.last_kv
        n = len(full) - 1  # what the last step kept (the row is freed when it ends)
        fresh = open_cache(model.session, model.manifest, 128)
        fresh.step(full[:-1], last_only=True)
        for got, exp in zip(cache.buffers, fresh.bound.kv.buffers):
            np.testing.assert_allclose(got[:, :, :n], exp[:, :, :n], atol=1e-5)
