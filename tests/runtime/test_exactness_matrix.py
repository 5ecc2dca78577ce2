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
    from specport.errors import InputError

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
    import torch

    import specport
    from specport.exporter.export import export_model
    from specport.exporter.mtp_heads import MTPHeads
    from specport.exporter.mtp_train import load_base, write_mtp_artifact
    from tests.fixtures import TINY, make_llama

    tmp: Path = tmp_path_factory.mktemp("exactness")
    hf = make_llama(tmp / "hf", context_length=128, initializer_range=0.2, **TINY)  # type: ignore[arg-type]
    out: dict[str, Any] = {}
    for layout in LAYOUTS:
        export_model(
            hf, tmp / layout, kv_layout=layout, tree_mask=True, skip_verify=True, progress=False
        )
        out[layout] = specport.load(tmp / layout, threads=1)
        torch.manual_seed(0)
        heads = MTPHeads(load_base(out[layout].manifest), 2).eval()
        write_mtp_artifact(tmp / layout, heads, tmp / f"mtp_{layout}", {"source": "test"})
        out[f"mtp_{layout}"] = specport.load(tmp / f"mtp_{layout}", threads=1, mtp_branch=True)
    return out


def _plain(model: Any, verifier: str) -> list[list[int]]:
    kw = VERIFIERS[verifier]
    return [
        model.generate(prompt_ids=p, max_new_tokens=NEW, ignore_eos=True, **kw).tokens
        for p in PROMPTS
    ]


@slow
@pytest.mark.parametrize("verifier", list(VERIFIERS))
@pytest.mark.parametrize("proposer", ["ngram", "suffix", "mtp", "ngram-tree"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_batch1_loops_equal_plain(arts, layout, proposer, verifier):
    """The batch-1 chain loop, the MTP graph path and the token tree, both layouts."""
    base = arts[layout]
    model = arts[f"mtp_{layout}"] if proposer == "mtp" else base
    want = _plain(base, verifier)
    method = "ngram" if proposer == "ngram-tree" else proposer
    width = 3 if proposer == "ngram-tree" else 1
    for p, ref in zip(PROMPTS, want):
        got = model.generate(
            prompt_ids=p,
            max_new_tokens=NEW,
            ignore_eos=True,
            speculative=method,
            num_draft=2,
            tree_width=width,
            **VERIFIERS[verifier],
        )
        assert got.tokens == ref, (layout, proposer, verifier, p)
        spec = got.metrics["speculative"]
        assert spec["steps"] >= 1 and got.metrics["step_overhead_ms"] is not None


@slow
@pytest.mark.parametrize("verifier", list(VERIFIERS))
@pytest.mark.parametrize("proposer", ["ngram", "suffix", "mtp"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_batched_generator_equals_plain(arts, layout, proposer, verifier):
    """Several prompts in one speculative batch: the concat layout's batched generator, the
    shared layout's one step driven synchronously (`engine.driver`)."""
    model = arts[f"mtp_{layout}"] if proposer == "mtp" else arts[layout]
    want = _plain(arts[layout], verifier)
    got = model.generate_batch(
        prompt_ids=PROMPTS,
        max_new_tokens=NEW,
        ignore_eos=True,
        speculative=proposer,
        num_draft=2,
        **VERIFIERS[verifier],
    )
    assert [g.tokens for g in got] == want, (layout, proposer, verifier)
    assert [g.finish_reason for g in got] == ["length"] * len(PROMPTS)
    assert got[0].metrics["speculative"]["steps"] >= 1
    assert got[0].metrics["step_overhead_ms"] is not None


@slow
@pytest.mark.parametrize("verifier", list(VERIFIERS))
@pytest.mark.parametrize("proposer", ["ngram", "suffix"])
@pytest.mark.parametrize("max_rows", [8, 1], ids=["rows-verify-alone", "compute-bound-rule"])
def test_engine_staggered_and_cancelled_equal_plain(arts, proposer, verifier, max_rows):
    """The serving engine (shared layout): arrivals while others decode, more requests than
    rows, a cancellation mid-generation; every finished request equals plain greedy."""
    from specport.runtime.engine import Request
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
