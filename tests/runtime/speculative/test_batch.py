"""Several prompts speculating together through the engine's one step (``engine.driver``) on
the concat layout (``kv.concat_cache.ConcatKVCache``): every row equals plain greedy across
architectures, methods and draft lengths; EOS, stop and the context window end rows alone;
sampling is seeded and lossless. Layout x proposer x verifier is ``test_exactness_matrix``;
the cache's own unit tests are in ``tests/runtime/kv/test_cache.py``."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from specport.core.errors import ContextLengthError, InputError, UsageError
from specport.runtime.engine.driver import generate_rows
from specport.runtime.sampler import SamplingConfig
from specport.runtime.speculative.base import Drafts, adopt
from specport.runtime.speculative.loop import default_adaptive, proposer_factory
from specport.runtime.speculative.verify import graph_verdict, greedy_rows, greedy_verify
from tests.runtime.speculative.helpers import RandomProposer, first_two_law, total_variation

GREEDY = SamplingConfig()
slow = pytest.mark.slow  # the model fixtures export tiny models (a few seconds each)


def test_greedy_rows_equals_greedy_verify():
    rng = np.random.default_rng(0)
    for _ in range(50):
        logits = rng.standard_normal((4, 5, 7)).astype(np.float32)
        best = logits.argmax(-1)
        rows = [
            [int(best[b, j]) if rng.random() < 0.7 else int(rng.integers(7)) for j in range(n)]
            for b, n in enumerate(rng.integers(0, 5, size=4))
        ]
        drafts = Drafts.from_lists(rows)
        want = greedy_verify(drafts, logits[:, : drafts.width + 1])
        got = greedy_rows(drafts, logits)
        assert got.tokens == want.tokens and got.accepted.tolist() == want.accepted.tolist()
        assert got.bonus.tolist() == want.bonus.tolist()


def test_graph_verdict_stops_at_a_rows_drafts():
    """A filler equal to the argmax makes the graph accept past a row's drafts; exact greedy
    stops at the drafts and emits that argmax (the filler) as its extra token."""
    drafts = Drafts.from_lists([[7], [], [8, 9]])
    res = graph_verdict(drafts, [2, 1, 1], [0, 0, 33], filler=0)  # rows 0 and 1: a filler matched
    assert res.accepted.tolist() == [1, 0, 1]
    assert res.tokens == [[7, 0], [0], [8, 33]]
    assert res.bonus.tolist() == [True, True, False]


def _spec(
    model: Any,
    prompts: list[list[int]],
    max_new_tokens: int,
    method: str,
    num_draft: int,
    draft: Any = None,
    sampling: SamplingConfig | None = None,
    eos: Any = (),
    on_token: Any = None,
    adaptive: bool | None = None,
    graph_verify: bool = True,
) -> tuple[list[list[int]], list[str], dict[str, Any]]:
    """What ``Model.generate_batch(speculative=...)`` runs, with token ids in and out."""
    first, make = proposer_factory(method, model, num_draft, draft)
    out = generate_rows(
        model,
        prompts,
        max_new_tokens,
        make,
        num_draft,
        sampling,
        eos,
        on_token,
        default_adaptive(first) if adaptive is None else adaptive,
        method,
        graph_verify=graph_verify,
    )
    return out.tokens, out.finish_reasons, out.metrics


def _load(path: Path):
    import specport

    return specport.load(path, mtp_branch=True)  # low-level loops run the MTP session


@pytest.fixture(scope="module")
def llama(tiny_zoo, tmp_path_factory):
    """The zoo's tiny Llama, its 1-layer self-draft and a copy with 2 untrained MTP heads."""
    pytest.importorskip("torch")
    from tests.export_cache import cached_export, cached_mtp

    model = _load(tiny_zoo.artifact("llama", fuse=False))
    tmp = tmp_path_factory.mktemp("spec_batch")
    cached_export(
        tiny_zoo.source("llama"), tmp / "l1", fuse=False, layers=1, skip_verify=True, progress=False
    )
    cached_mtp(model.path, tmp / "mtp", heads=2)
    return model, _load(tmp / "l1"), _load(tmp / "mtp")


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts of 1..33 tokens; some repeat themselves so the n-gram proposer has hits."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        base = rng.integers(3, 256, size=int(rng.integers(1, 12))).tolist()
        out.append(base * (1 + i % 3))
    out[0] = out[0][:1]  # a one-token prompt: nothing to prefill for that row
    return out


def _plain(model, prompts, n, eos=True):
    return [
        r.tokens
        for r in model.generate_batch(prompt_ids=prompts, max_new_tokens=n, ignore_eos=not eos)
    ]


def _random(model, prompts, n: int, k: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return generate_rows(
        model, prompts, n, lambda: adopt(RandomProposer(rng, any_length=True)), k, method="random"
    ).tokens


@slow
@pytest.mark.parametrize("arch", ["llama", "mistral", "gpt2", "phi3"])
def test_greedy_equals_plain_across_architectures(tiny_zoo, arch):
    """Left padding + ragged drafts: each row equals plain batched and one-by-one decoding."""
    model = _load(tiny_zoo.artifact(arch, fuse=False))
    prompts = _prompts(7, seed=1)
    for batch in (prompts[:2], prompts[2:5], prompts[3:7]):
        plain = _plain(model, batch, 20, eos=False)
        one = [
            model.generate(prompt_ids=p, max_new_tokens=20, ignore_eos=True).tokens for p in batch
        ]
        assert plain == one
        toks, reasons, metrics = _spec(model, batch, 20, "ngram", 4)
        assert toks == plain, arch
        assert reasons == ["length"] * len(batch)
        assert _random(model, batch, 20, 4) == plain, arch
        assert metrics["batch"] == len(batch) and metrics["new_tokens"] == 20 * len(batch)


@slow
@pytest.mark.parametrize("method,k", [("ngram", 1), ("ngram", 5), ("draft", 2), ("draft", 4)])
def test_methods_greedy_equal_plain(llama, method, k):
    model, draft, _ = llama
    prompts = _prompts(8, seed=2)
    for batch in (prompts[:4], prompts[4:7], prompts[6:8]):
        toks, reasons, metrics = _spec(model, batch, 24, method, k, draft, GREEDY, ())
        assert toks == _plain(model, batch, 24, eos=False), (method, k)
        spec = metrics["speculative"]
        assert spec["method"] == method and spec["num_draft"] == k
        assert len(spec["rows"]) == len(batch)
        assert spec["steps"] == sum(r["steps"] for r in spec["rows"])
        assert 1.0 <= spec["mean_accepted_length"] <= k + 1


@slow
def test_adaptive_draft_length_stays_exact(llama):
    model, draft, _ = llama
    prompts = _prompts(4, seed=6)
    plain = _plain(model, prompts, 24, eos=False)
    for method in ("ngram", "draft"):
        toks, _, metrics = _spec(model, prompts, 24, method, 4, draft, adaptive=True)
        assert toks == plain and metrics["speculative"]["adaptive"] is True


@slow
def test_self_draft_accepts_everything(llama):
    model, _, _ = llama
    prompts = _prompts(4, seed=3)
    toks, _, metrics = _spec(model, prompts, 21, "draft", 4, model, adaptive=False)
    assert toks == _plain(model, prompts, 21, eos=False)
    assert metrics["speculative"]["acceptance_rate"] == 1.0
    assert metrics["decode_steps"] == 5  # 21 tokens in steps of 5, 5, 5, 5, 1


@slow
def test_adaptive_draft_length_weighs_the_measured_verify_costs(llama):
    """Under greedy decoding at batch 1 the adaptive draft length prices drafts by the verify
    costs it is given (``engine.step_cost.live_verify_costs``) and times its steps for them:
    n-gram drafts on a prompt that repeats itself are made where verifying is free; where
    verifying a draft costs ten plain steps only a probe (one draft every 16 timed steps) is;
    the tokens are plain greedy's either way."""
    from specport.runtime.engine.step_cost import PROBE_EVERY, LiveVerifyCosts

    model, _, _ = llama
    prompt = _prompts(4, seed=3)[2]  # a short sequence three times
    want = _plain(model, [prompt], 24, eos=False)
    _, make = proposer_factory("ngram", model, 4)  # proposing costs nothing
    for costs in ([1.0, 10.0, 20.0, 30.0, 40.0], [1.0] * 5):  # drafts priced out, then free
        live = LiveVerifyCosts(costs)
        out = generate_rows(
            model, [prompt], 24, make, 4, GREEDY, (), None, True, "ngram", live_costs=live
        )
        assert out.tokens == want
        spec = out.metrics["speculative"]
        assert live.steps == spec["steps"] - 1  # every step timed but the last
        if costs[1] > 1.0:
            assert spec["drafted"] <= 1 + spec["steps"] // PROBE_EVERY  # probes only
        else:
            assert spec["drafted"] > 1 + spec["steps"] // PROBE_EVERY


@slow
def test_mtp_greedy_equals_plain(llama):
    """Both verifications: the graph's own (greedy default) and the host's."""
    model, _, mtp = llama
    prompts = _prompts(6, seed=4)
    for batch in (prompts[:3], prompts[2:6]):
        plain = _plain(model, batch, 20, eos=False)
        for k in (1, 2):
            toks, _, metrics = _spec(mtp, batch, 20, "mtp", k)
            assert toks == plain, k
            assert metrics["speculative"]["drafted"] > 0  # rows read their drafts from the graph
            host, _, metrics = _spec(mtp, batch, 20, "mtp", k, graph_verify=False)
            assert host == plain and metrics["speculative"]["drafted"] > 0
    with pytest.raises(InputError, match="MTP heads"):
        _spec(mtp, prompts[:2], 4, "mtp", 3)


@slow
def test_per_row_eos_stop_and_context(llama):
    model, draft, _ = llama
    prompts = _prompts(3, seed=7)
    plain = _plain(model, prompts, 16, eos=False)
    eos = plain[1][4]  # row 1 ends at its 5th token; the others end wherever eos appears
    want = [t[: t.index(eos) + 1] if eos in t else t for t in plain]
    toks, reasons, _ = _spec(model, prompts, 16, "ngram", 3, eos=[eos])
    assert toks == want
    assert reasons == ["eos" if eos in t else "length" for t in plain]

    def stop(row: int, tok: int) -> bool:
        return row == 2 and tok == plain[2][2]  # row 2 stops at its 3rd token

    toks, reasons, _ = _spec(model, prompts, 16, "draft", 3, draft, on_token=stop)
    assert toks[2] == plain[2][: plain[2].index(plain[2][2]) + 1] and reasons[2] == "stop"
    assert toks[:2] == plain[:2] and reasons[:2] == ["length", "length"]

    # A row near the end of the 128-token window stops at the window ("context"); others go on.
    ctx = model.manifest.context_length
    long = (prompts[1] * ctx)[: ctx - 6]
    batch = [prompts[0], long]
    toks, reasons, _ = _spec(model, batch, 12, "ngram", 4)
    one = [model.generate(prompt_ids=p, max_new_tokens=12, ignore_eos=True) for p in batch]
    assert toks == [r.tokens for r in one]
    assert reasons == ["length", "context"] == [r.finish_reason for r in one]


@slow
def test_edge_shapes_and_greedy_penalty(llama):
    """One-token prompts only (no prefill), batch 1, one new token, greedy with a penalty."""
    model, draft, _ = llama
    ones = [[5], [77], [200]]
    assert _spec(model, ones, 12, "ngram", 3)[0] == _plain(model, ones, 12, False)
    single = _prompts(3, seed=9)[2:]
    assert _spec(model, single, 12, "draft", 3, draft)[0] == _plain(model, single, 12, False)
    toks, reasons, metrics = _spec(model, ones, 1, "draft", 3, draft)
    assert toks == _plain(model, ones, 1, False) and reasons == ["length"] * 3
    assert metrics["speculative"]["drafted"] == 0  # no room for drafts with one token to go
    prompts = _prompts(4, seed=10)
    cfg = SamplingConfig(greedy=True, repetition_penalty=1.3)
    want = model.generate_batch(
        prompt_ids=prompts, max_new_tokens=16, greedy=True, repetition_penalty=1.3, ignore_eos=True
    )
    for method in ("ngram", "draft"):
        got = _spec(model, prompts, 16, method, 3, draft, cfg)[0]
        assert got == [r.tokens for r in want], method


@slow
def test_bad_inputs(llama):
    model, _, _ = llama
    ctx = model.manifest.context_length
    with pytest.raises(InputError, match="empty"):
        _spec(model, [], 4, "ngram", 2)
    with pytest.raises(ContextLengthError, match="context window"):
        _spec(model, [[5, 6], [7] * ctx], 4, "ngram", 2)
    with pytest.raises(InputError, match="at least one token"):
        _spec(model, [[5, 6], []], 4, "ngram", 2)
    with pytest.raises(InputError, match="vocabulary"):
        _spec(model, [[5, 6], [10_000]], 4, "ngram", 2)
    with pytest.raises(InputError, match="max-new-tokens"):
        _spec(model, [[5, 6]], 0, "ngram", 2)
    with pytest.raises(UsageError, match="num_draft"):  # the API checks it before the loop
        model.generate_batch(
            prompt_ids=[[5, 6]], max_new_tokens=4, speculative="ngram", num_draft=0
        )
    with pytest.raises(InputError, match="--draft"):
        _spec(model, [[5, 6]], 4, "draft", 2)
    with pytest.raises(InputError, match="MTP"):
        _spec(model, [[5, 6]], 4, "mtp", 2)
    with pytest.raises(InputError, match="unknown"):
        _spec(model, [[5, 6]], 4, "medusa", 2)


@slow
@pytest.mark.parametrize("method", ["ngram", "draft", "mtp"])
def test_sampling_is_seeded(llama, method):
    model, draft, mtp = llama
    target = mtp if method == "mtp" else model
    prompts = _prompts(3, seed=8)
    cfg = SamplingConfig(greedy=False, temperature=0.8, top_p=0.95, repetition_penalty=1.1, seed=5)
    a = _spec(target, prompts, 16, method, 2, draft, cfg)[0]
    b = _spec(target, prompts, 16, method, 2, draft, cfg)[0]
    assert a == b and all(len(t) == 16 for t in a)
    assert all(0 <= t < model.manifest.vocab_size for row in a for t in row)
    other = SamplingConfig(greedy=False, temperature=0.8, top_p=0.95, seed=6)
    assert _spec(target, prompts, 16, method, 2, draft, other)[0] != a


@slow
def test_rejection_sampling_preserves_distribution(llama):
    """Joint law of each row's first two sampled tokens equals the target's (draft model)."""
    model, draft, _ = llama
    ids = [5, 17, 42]
    cfg = dict(greedy=False, temperature=1.0, top_k=3)
    expected = first_two_law(model, ids, SamplingConfig(**cfg))
    counts: Counter[tuple[int, int]] = Counter()
    drafted = 0
    runs, rows = 400, 4
    for seed in range(runs):
        toks, _, metrics = _spec(
            model, [ids] * rows, 3, "draft", 2, draft, SamplingConfig(**cfg, seed=seed)
        )
        counts.update((t[0], t[1]) for t in toks)
        drafted += metrics["speculative"]["drafted"]
    n = runs * rows
    assert drafted > n // 10
    tv = total_variation(counts, expected)
    assert tv < 0.06, (tv, counts, expected)


STORY_PROMPTS = [
    "Once upon a time",
    "Lily and Ben went to the park.",
    "The cat sat on the mat. The cat sat on the mat. The cat",
    "One day, a little boy named Tim",
    "Tom had a red ball. He liked to play with his red ball. One day, Tom",
    "Sue",
]


@pytest.fixture(scope="module")
def stories(shared_path, tmp_path_factory):
    """stories260K, its 1-layer self-draft and a copy with 3 untrained MTP heads."""
    from tests.export_cache import cached_export, cached_mtp

    src = shared_path("models", "stories260K")
    out = tmp_path_factory.mktemp("spec_batch_stories")
    cached_export(src, out / "s260", fuse=False, skip_verify=True, progress=False)
    cached_export(src, out / "l1", fuse=False, layers=1, skip_verify=True, progress=False)
    model = _load(out / "s260")
    cached_mtp(model.path, out / "mtp", heads=3)
    return model, _load(out / "l1"), _load(out / "mtp")


@slow
@pytest.mark.parametrize("method", ["ngram", "draft", "mtp"])
def test_stories260k_greedy_equals_plain(stories, method):
    model, draft, mtp = stories
    target = mtp if method == "mtp" else model
    eos = model.manifest.eos_token_ids
    ids = [model.encode(t) for t in STORY_PROMPTS]
    for batch in (ids[:4], ids[3:6]):
        plain = model.generate_batch(prompt_ids=batch, max_new_tokens=60)
        one = [model.generate(prompt_ids=p, max_new_tokens=60) for p in batch]
        assert [r.tokens for r in plain] == [r.tokens for r in one]
        toks, reasons, metrics = _spec(target, batch, 60, method, 3, draft, GREEDY, eos)
        assert toks == [r.tokens for r in plain], method
        assert reasons == [r.finish_reason for r in plain]
        if method == "mtp":  # and with the host verifying (logits out of the graph)
            host = _spec(target, batch, 60, method, 3, draft, GREEDY, eos, graph_verify=False)
            assert host[:2] == (toks, reasons)
        if method == "ngram":
            assert metrics["speculative"]["accepted"] > 0
