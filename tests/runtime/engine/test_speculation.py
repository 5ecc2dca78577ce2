"""Speculative decoding inside the batching engine (shared KV layout) against plain greedy.

Greedy output must be `Model.generate`'s plain greedy output token for token, whatever the
traffic: requests arriving while others decode, a cancellation mid-generation, prefix-cache
hits, rows speculating beside rows that decode batched. Sampling goes through lossless
rejection sampling: seeded runs are reproducible and the acceptance counters stay sane.
"""

from __future__ import annotations

import pytest

from specport.core.errors import InputError
from specport.runtime.engine import make_engine
from specport.runtime.engine.base import Request
from specport.runtime.engine.batching import BatchingEngine
from specport.runtime.engine.step_cost import StepCost
from specport.runtime.sampler import SamplingConfig

# repeated patterns: the n-gram proposer finds matches, so drafts are accepted and rejected
PROMPTS = [
    [1, 3, 4] * 9,
    [1, 74, 75, 76, 90, 74, 75, 76, 90, 74],
    [1, 100],
    [1, 5, 6, 7, 8, 9, 10, 11, 12, 5, 6, 7],
    [1, 200, 201, 30, 31, 32, 33],
]
NEW = [30, 24, 20, 16, 28]


@pytest.fixture(scope="module")
def reference(shared_model):
    return [
        shared_model.generate(prompt_ids=p, max_new_tokens=n, ignore_eos=True).tokens
        for p, n in zip(PROMPTS, NEW)
    ]


def _submit(eng, i, **kw):
    return eng.submit(Request(PROMPTS[i], NEW[i], ignore_eos=True, **kw))


@pytest.mark.parametrize("method", ["ngram", "suffix"])
@pytest.mark.parametrize("max_rows", [8, 1], ids=["every-row-speculates", "compute-bound-rule"])
def test_staggered_arrivals_and_cancel_equal_plain_greedy(
    shared_model, reference, max_rows, method
):
    eng = BatchingEngine(
        shared_model, max_batch=3, prefill_chunk=4, speculative=method, spec_max_rows=max_rows
    )
    try:
        first = _submit(eng, 0)
        events = first.events(timeout=60)
        # the first request has started; under load its first event may already hold every
        # token (the text thread sends the tokens waiting together as one event)
        head = next(events)
        doomed = eng.submit(Request(PROMPTS[2], 100, ignore_eos=True))
        rest = [_submit(eng, i) for i in (1, 3, 4)]  # more than max_batch: some wait for a row
        next(doomed.events(timeout=60))
        doomed.cancel()  # mid-generation: its row is freed for a waiting request
        seen = [head, *events]
        assert [t for ev in seen for t in ev.token_ids] == reference[0]
        assert seen[-1].finish_reason == "length"
        for i, handle in zip((1, 3, 4), rest):
            result = handle.result(timeout=60)
            assert result.token_ids == reference[i], i
            assert result.finish_reason == "length"
        assert doomed.result(timeout=60).finish_reason == "cancelled"
        stats = eng.stats()
        assert stats["errors"] == 0 and stats["cancelled"] == 1
        assert stats["spec_steps"] > 0 and stats["spec_accepted_tokens"] > 0
        assert stats["spec_accepted_tokens"] <= stats["spec_draft_tokens"]
    finally:
        eng.close()


def test_first_request_tokens_equal_plain_greedy(shared_model, reference):
    eng = BatchingEngine(shared_model, max_batch=2, speculative="ngram", spec_max_rows=8)
    try:
        handles = [_submit(eng, i) for i in range(len(PROMPTS))]
        for i, handle in enumerate(handles):
            assert handle.result(timeout=60).token_ids == reference[i], i
        # a chat's next turn starts with the previous exchange: prefix-cache hit, same tokens
        follow = PROMPTS[0] + reference[0] + [40, 41, 42]
        want = shared_model.generate(prompt_ids=follow, max_new_tokens=12, ignore_eos=True)
        got = eng.submit(Request(follow, 12, ignore_eos=True)).result(timeout=60)
        assert got.token_ids == want.tokens
        stats = eng.stats()
        assert stats["prefix_cache_hits"] >= 1
        assert stats["spec_accepted_tokens"] > 0
    finally:
        eng.close()


def test_stop_string_logprobs_and_context_limit(shared_model, reference):
    eng = BatchingEngine(
        shared_model, max_batch=2, max_length=40, speculative="ngram", spec_max_rows=8
    )
    try:
        got = eng.submit(Request(PROMPTS[0], 30, ignore_eos=True, logprobs=2))
        events = list(got.events(timeout=60))
        tokens = [t for ev in events for t in ev.token_ids]
        assert tokens == reference[0][: len(tokens)]
        assert events[-1].finish_reason == "context"  # 27 prompt + 13 new = 40 positions
        assert len(tokens) == 40 - len(PROMPTS[0])
        logprobs = [lp for ev in events for lp in ev.logprobs or []]
        assert [lp.token for lp in logprobs] == tokens
        assert all(lp.logprob <= 0 and len(lp.top) == 2 for lp in logprobs)
    finally:
        eng.close()


def test_seeded_sampling_reproducible_and_acceptance_sane(shared_model):
    eng = BatchingEngine(shared_model, max_batch=2, speculative="ngram", spec_max_rows=8)
    config = SamplingConfig(greedy=False, temperature=0.7, top_k=5, seed=11)
    try:
        a = eng.submit(Request(PROMPTS[0], 24, sampling=config, ignore_eos=True))
        a_tokens = a.result(timeout=60).token_ids
        b = eng.submit(Request(PROMPTS[0], 24, sampling=config, ignore_eos=True))
        assert b.result(timeout=60).token_ids == a_tokens  # alone, same seed: same tokens
        stats = eng.stats()
        assert stats["spec_steps"] > 0
        assert 0 <= stats["spec_accepted_tokens"] <= stats["spec_draft_tokens"]
        assert stats["generated_tokens"] == 48
    finally:
        eng.close()


def test_make_engine_picks_batching_for_shared_speculation(shared_model, reference):
    eng = make_engine(shared_model, max_batch=4, speculative="ngram", num_draft=3)
    try:
        assert isinstance(eng, BatchingEngine)
        assert eng.stats()["speculative"] == "ngram" and eng.stats()["spec_num_draft"] == 3
        assert _submit(eng, 1).result(timeout=60).token_ids == reference[1]
    finally:
        eng.close()
    with pytest.raises(InputError, match="draft"):
        make_engine(shared_model, speculative="draft")
    with pytest.raises(InputError, match="MTP"):
        make_engine(shared_model, speculative="mtp")


def test_penalties_match_generate(shared_model):
    """Greedy with a repetition penalty verifies on penalized scores: generate's tokens."""
    want = shared_model.generate(
        prompt_ids=PROMPTS[0], max_new_tokens=20, repetition_penalty=1.3, ignore_eos=True
    ).tokens
    eng = BatchingEngine(shared_model, max_batch=2, speculative="ngram", spec_max_rows=8)
    try:
        config = SamplingConfig(greedy=True, repetition_penalty=1.3)
        got = eng.submit(Request(PROMPTS[0], 20, sampling=config, ignore_eos=True))
        assert got.result(timeout=60).token_ids == want
        # presence / frequency penalties are not verified speculatively: the row decodes plainly
        config = SamplingConfig(greedy=True, frequency_penalty=0.5)
        want = shared_model.generate(
            prompt_ids=PROMPTS[1], max_new_tokens=12, sampling=config, ignore_eos=True
        ).tokens
        before = eng.stats()["spec_steps"]
        got = eng.submit(Request(PROMPTS[1], 12, sampling=config, ignore_eos=True))
        assert got.result(timeout=60).token_ids == want
        assert eng.stats()["spec_steps"] == before
    finally:
        eng.close()


@pytest.mark.parametrize("num_draft", [2, 4])
def test_rows_verified_together_equal_plain_greedy(shared_model, reference, num_draft):
    """Several rows decoding at once verify their drafts in one batched run (the graph feeds
    GroupQueryAttention query_seqlens): rows that drafted and rows that did not share the run,
    rows join mid-generation and one is cancelled, and every request still gets exactly plain
    greedy's tokens."""
    eng = BatchingEngine(
        shared_model,
        max_batch=4,
        prefill_chunk=4,
        speculative="ngram",
        num_draft=num_draft,
        spec_max_tokens=16,
    )
    try:
        assert eng.spec is not None and eng.spec.batched and eng.spec.cost is not None
        eng.spec.cost = StepCost(1.0, 0.0)  # every width costs the same: pad to the widest
        first = [_submit(eng, i) for i in (0, 1)]
        doomed = eng.submit(Request(PROMPTS[2], 100, ignore_eos=True))
        next(doomed.events(timeout=60))
        later = [_submit(eng, i) for i in (3, 4)]  # join while the others decode
        doomed.cancel()
        for i, handle in zip((0, 1, 3, 4), [*first, *later]):
            result = handle.result(timeout=60)
            assert result.token_ids == reference[i], i
            assert result.finish_reason == "length"
        stats = eng.stats()
        assert stats["errors"] == 0 and stats["spec_batched_steps"] > 0
        assert 0 < stats["spec_accepted_tokens"] <= stats["spec_draft_tokens"]
    finally:
        eng.close()


def test_rows_decode_plainly_where_the_measured_cost_says_drafts_do_not_pay(
    shared_model, reference
):
    """Where each extra token of a run costs far more than a plain step (the step cost the
    engine measured), rows never verify together: they decode in plain batched steps and
    still get plain greedy's tokens."""
    eng = BatchingEngine(shared_model, max_batch=3, speculative="ngram", num_draft=4)
    assert eng.spec is not None
    eng.spec.cost = StepCost(0.01, 1.0)
    try:
        handles = [_submit(eng, i) for i in (0, 1, 3)]
        for i, handle in zip((0, 1, 3), handles):
            assert handle.result(timeout=60).token_ids == reference[i], i
        assert eng.stats()["spec_batched_steps"] == 0
    finally:
        eng.close()


def test_rows_verified_together_sample_within_the_vocabulary(shared_model):
    """Sampled rows verify together through lossless rejection sampling: they finish with
    their full budget of in-vocabulary tokens and sane acceptance counters."""
    eng = BatchingEngine(
        shared_model, max_batch=3, speculative="ngram", num_draft=3, spec_max_tokens=16
    )
    assert eng.spec is not None
    eng.spec.cost = StepCost(1.0, 0.0)
    try:
        handles = [
            eng.submit(
                Request(
                    PROMPTS[i],
                    24,
                    ignore_eos=True,
                    sampling=SamplingConfig(greedy=False, temperature=0.7, top_k=5, seed=i),
                )
            )
            for i in range(3)
        ]
        results = [h.result(timeout=60) for h in handles]
        vocab = shared_model.manifest.vocab_size
        assert all(len(r.token_ids) == 24 and max(r.token_ids) < vocab for r in results)
        stats = eng.stats()
        assert stats["errors"] == 0 and stats["spec_batched_steps"] > 0
        assert 0 <= stats["spec_accepted_tokens"] <= stats["spec_draft_tokens"]
    finally:
        eng.close()


@pytest.mark.parametrize("fed", [True, False])
def test_batched_steps_only_where_attention_gets_query_seqlens(tmp_path, fed):
    """An artifact exported before its attention was fed query_seqlens verifies row by row."""
    import onnx
    from onnx import TensorProto, helper

    from specport.runtime.kv.cache import takes_batched_steps

    names = ["q", "k", "v", "pk", "pv", "sl", "tl", *[""] * 9, "qs" if fed else ""]
    while not names[-1]:
        names.pop()
    node = helper.make_node(
        "GroupQueryAttention", names, ["o"], domain="com.microsoft", num_heads=2, kv_num_heads=1
    )
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in names if n]
    out = helper.make_tensor_value_info("o", TensorProto.FLOAT, None)
    onnx.save(helper.make_model(helper.make_graph([node], "g", inputs, [out])), tmp_path / "m.onnx")
    assert takes_batched_steps(tmp_path / "m.onnx") is fed


def test_suffix_engine_learns_answers_and_keeps_plain_tokens(shared_model, reference):
    """A served answer becomes a corpus entry: the same question again is drafted from it."""
    index = shared_model.suffix_index
    eng = make_engine(shared_model, max_batch=2, speculative="suffix", num_draft=4)
    try:
        before = len(index)
        assert _submit(eng, 4).result(timeout=60).token_ids == reference[4]
        assert len(index) == before + len(reference[4]) + 1  # the answer and a separator
        accepted = eng.stats()["spec_accepted_tokens"]
        assert _submit(eng, 4).result(timeout=60).token_ids == reference[4]
        assert eng.stats()["spec_accepted_tokens"] - accepted >= len(reference[4]) // 2
        index.learn = False  # e.g. a benchmark repeating its prompts
        assert _submit(eng, 1).result(timeout=60).token_ids == reference[1]
        assert len(index) == before + len(reference[4]) * 2 + 2
    finally:
        index.learn = True
        eng.close()
