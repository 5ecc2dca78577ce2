"""Speculative loop: greedy output equals plain greedy, sampling stays lossless, KV stays exact."""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from specport.core.errors import InputError
from specport.runtime.kv.seq_cache import open_cache
from specport.runtime.sampler import SamplingConfig
from specport.runtime.speculative.draft import DraftModelProposer
from specport.runtime.speculative.loop import (
    SpeculativeGenerator,
    check_num_draft,
    generate_speculative,
)
from tests.runtime.speculative.helpers import RandomProposer, first_two_law, total_variation

pytestmark = pytest.mark.slow  # the session fixture exports two tiny models (~10-30 s)


def _export(tmp: Path, name: str, layers: int | None = None):
    import specport
    from specport.exporter.export import export_model
    from tests.fixtures import build_tiny_model

    src = tmp / "src"
    if not src.exists():
        build_tiny_model("llama", src)
    out = tmp / name
    export_model(src, out, fuse=False, layers=layers, skip_verify=True, progress=False)
    return specport.load(out)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("spec_tiny")
    return _export(tmp, "full"), _export(tmp, "l1", layers=1)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        base = rng.integers(3, 256, size=int(rng.integers(1, 12))).tolist()
        out.append(base * (1 + i % 3))  # some prompts repeat themselves: n-gram hits
    return out


@pytest.mark.parametrize("method,k", [("ngram", 1), ("ngram", 4), ("draft", 2), ("draft", 5)])
def test_greedy_equals_plain(tiny, method, k):
    model, draft = tiny
    for ids in _prompts(8):
        plain = model.generate(prompt_ids=ids, max_new_tokens=24, ignore_eos=True)
        toks, reason, metrics = generate_speculative(
            model, ids, 24, method, k, draft, SamplingConfig(), (), None
        )
        assert toks == plain.tokens, (method, k, ids)
        assert reason == "length"
        spec = metrics["speculative"]
        assert spec["steps"] >= 1 and 1.0 <= spec["mean_accepted_length"] <= k + 1
        assert len(spec["accepted_per_position"]) <= k


def test_self_draft_accepts_everything(tiny):
    model, _ = tiny
    ids = _prompts(1, seed=3)[0]
    plain = model.generate(prompt_ids=ids, max_new_tokens=20, ignore_eos=True)
    toks, _, metrics = generate_speculative(  # fixed K: adaptive would (rightly) stop drafting
        model, ids, 20, "draft", 4, model, SamplingConfig(), (), None, adaptive=False
    )
    assert toks == plain.tokens
    assert metrics["speculative"]["acceptance_rate"] == 1.0
    assert metrics["speculative"]["mean_accepted_length"] > 4.0  # last step may be shortened


def kept_kv(monkeypatch) -> dict:
    """What a concat cache's row holds when the driver frees it at the end of a generation
    (``{"kv": [[1, Hkv, L, D] per tensor]}``), for comparing with a one-run reference."""
    from specport.runtime.kv.concat_cache import ConcatKVCache

    kept: dict = {}
    real_free = ConcatKVCache.free

    def free(self, row):
        kept["kv"] = [np.array(p) for p in self._row(row)]
        real_free(self, row)

    monkeypatch.setattr(ConcatKVCache, "free", free)
    return kept


def test_kv_after_rejections_equals_plain_state(tiny, monkeypatch):
    model, _ = tiny
    kept = kept_kv(monkeypatch)
    ids = _prompts(2, seed=5)[1]
    gen = SpeculativeGenerator(model.session, model.manifest, RandomProposer(), 4)
    out = gen.generate(ids, 16)
    plain = model.generate(prompt_ids=ids, max_new_tokens=16, ignore_eos=True)
    assert out.tokens == plain.tokens
    assert out.stats.num_accepted_tokens < out.stats.num_draft_tokens  # rejections happened
    # Reference: the cache of prompt + all emitted tokens but the last, computed in one run.
    ref = open_cache(model.session, model.manifest)
    seq = ids + out.tokens[:-1]
    ref.step(seq)
    presents = ref.bound._row(0)  # the row's [1, Hkv, L, D] per tensor
    assert kept["kv"][0].shape[2] == len(seq)
    for got, want in zip(kept["kv"], presents):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_eos_stop_and_budget(tiny):
    model, _ = tiny
    ids = _prompts(1, seed=7)[0]
    plain = model.generate(prompt_ids=ids, max_new_tokens=12, ignore_eos=True).tokens
    eos = plain[5]
    toks, reason, _ = generate_speculative(
        model, ids, 12, "ngram", 3, None, SamplingConfig(), [eos], None
    )
    assert toks == plain[: plain.index(eos) + 1] and reason == "eos"
    seen: list[int] = []
    toks, reason, _ = generate_speculative(
        model,
        ids,
        12,
        "draft",
        3,
        model,
        SamplingConfig(),
        (),
        lambda t: seen.append(t) or len(seen) == 4,
    )
    assert toks == plain[:4] == seen and reason == "stop"
    toks, reason, _ = generate_speculative(
        model, ids, 7, "draft", 5, model, SamplingConfig(), (), None
    )
    assert toks == plain[:7] and reason == "length"


@pytest.mark.parametrize("method", ["draft", "mtp"])
def test_rejection_sampling_preserves_distribution(tiny, request, method):
    """Joint law of the first two sampled tokens equals the target's, over many seeds."""
    model, draft = tiny
    spec_model = request.getfixturevalue("tiny_mtp") if method == "mtp" else model
    ids = [5, 17, 42]
    cfg = dict(greedy=False, temperature=1.0, top_k=3)
    expected = first_two_law(model, ids, SamplingConfig(**cfg))
    n = 1500
    counts: Counter[tuple[int, int]] = Counter()
    drafted = 0
    for seed in range(n):
        toks, _, metrics = generate_speculative(
            spec_model, ids, 3, method, 2, draft, SamplingConfig(**cfg, seed=seed), (), None
        )
        counts[(toks[0], toks[1])] += 1
        drafted += metrics["speculative"]["drafted"]
    assert drafted > n // 10  # the drafts really went through rejection sampling
    tv = total_variation(counts, expected)
    assert tv < 0.06, (tv, counts, expected)


def test_sampling_is_seeded(tiny):
    model, draft = tiny
    cfg = SamplingConfig(greedy=False, temperature=0.8, seed=11)
    a = generate_speculative(model, [5, 6, 7], 16, "draft", 3, draft, cfg, (), None)[0]
    b = generate_speculative(model, [5, 6, 7], 16, "draft", 3, draft, cfg, (), None)[0]
    assert a == b and len(a) == 16


def test_bad_inputs(tiny):
    model, draft = tiny
    for k in (0, 17, -1, True, 2.5):
        with pytest.raises(InputError, match="num-draft"):
            check_num_draft(k)
    other = dataclasses.replace(draft.manifest, config={**draft.manifest.config, "vocab_size": 300})
    with pytest.raises(InputError, match="vocabulary"):
        DraftModelProposer(draft.session, other, model.manifest.vocab_size)
    with pytest.raises(InputError, match="--draft"):
        generate_speculative(model, [1, 2], 4, "draft", 2, None, SamplingConfig(), (), None)
    with pytest.raises(InputError, match="MTP"):
        generate_speculative(model, [1, 2], 4, "mtp", 2, None, SamplingConfig(), (), None)
    with pytest.raises(InputError, match="unknown"):
        generate_speculative(model, [1, 2], 4, "medusa", 2, None, SamplingConfig(), (), None)
    with pytest.raises(InputError):
        generate_speculative(model, [], 4, "ngram", 2, None, SamplingConfig(), (), None)


@pytest.fixture(scope="session")
def stories(shared_path, tmp_path_factory):
    import specport
    from specport.exporter.export import export_model

    src = shared_path("models", "stories260K")
    out = tmp_path_factory.mktemp("spec_stories") / "s260"
    export_model(src, out, fuse=False, skip_verify=True, progress=False)
    return specport.load(out)


STORY_PROMPTS = [
    "Once upon a time",
    "Lily and Ben went to the park.",
    "The cat sat on the mat. The cat sat on the mat. The cat",
    "One day, a little boy named Tim",
    "Tom had a red ball. He liked to play with his red ball. One day, Tom",
    "Sue",
]


@pytest.mark.parametrize("k", [2, 4])
def test_stories260k_ngram_greedy_equals_plain(stories, k):
    for text in STORY_PROMPTS:
        ids = stories.encode(text)
        plain = stories.generate(prompt_ids=ids, max_new_tokens=80)
        toks, reason, _ = generate_speculative(
            stories,
            ids,
            80,
            "ngram",
            k,
            None,
            SamplingConfig(),
            stories.manifest.eos_token_ids,
            None,
        )
        assert toks == plain.tokens, text
        assert reason == plain.finish_reason


@pytest.fixture(scope="session")
def tiny_mtp(tiny, tmp_path_factory):
    """The tiny model with 2 untrained MTP heads spliced in (drafts are poor; output must not care)."""
    import specport
    from specport.exporter.mtp_artifact import write_mtp_artifact
    from specport.exporter.mtp_heads import MTPHeads
    from specport.train.mtp_train import load_base

    model, _ = tiny
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    heads = MTPHeads(load_base(model.manifest), 2).eval()
    out = tmp_path_factory.mktemp("spec_mtp") / "mtp"
    write_mtp_artifact(model.path, heads, out, {"source": "test"})
    return specport.load(out, mtp_branch=True)  # the low-level loops below run its session


def test_mtp_greedy_equals_plain(tiny, tiny_mtp):
    import onnxruntime as ort

    model, _ = tiny
    assert tiny_mtp.manifest.mtp["heads"] == 2
    bare = ort.InferenceSession(
        str(tiny_mtp.path / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    assert [o.name for o in bare.get_outputs()][-3:] == ["mtp_accepted", "mtp_bonus", "mtp_drafts"]
    for ids in _prompts(6, seed=9):
        plain = model.generate(prompt_ids=ids, max_new_tokens=20, ignore_eos=True)
        assert (
            tiny_mtp.generate(prompt_ids=ids, max_new_tokens=20, ignore_eos=True).tokens
            == plain.tokens
        )
        for k in (1, 2):
            toks, _, metrics = generate_speculative(  # fixed K: untrained heads may not pay
                tiny_mtp, ids, 20, "mtp", k, None, SamplingConfig(), (), None, False
            )
            assert toks == plain.tokens, (k, ids)
            assert metrics["speculative"]["drafted"] > 0
    with pytest.raises(InputError, match="MTP heads"):
        generate_speculative(tiny_mtp, [1, 2], 4, "mtp", 3, None, SamplingConfig(), (), None)
    # Sampling: host rejection sampling decides; in-graph drafts are used only when they agree.
    cfg = SamplingConfig(greedy=False, temperature=0.7, seed=3)
    a = generate_speculative(tiny_mtp, [5, 6, 7], 16, "mtp", 2, None, cfg, (), None)[0]
    assert a == generate_speculative(tiny_mtp, [5, 6, 7], 16, "mtp", 2, None, cfg, (), None)[0]
    assert len(a) == 16


def test_stories260k_mtp_and_draft_greedy_equal_plain(stories, shared_path, tmp_path_factory):
    """Real model, untrained heads and a 1-layer self-draft: acceptance is poor, output exact."""
    import specport
    from specport.exporter.export import export_model
    from specport.exporter.mtp_artifact import write_mtp_artifact
    from specport.exporter.mtp_heads import MTPHeads
    from specport.runtime.speculative.mtp import MTPProposer
    from specport.train.mtp_train import load_base

    base = load_base(stories.manifest)
    out = tmp_path_factory.mktemp("spec_stories_mtp")
    write_mtp_artifact(stories.path, MTPHeads(base, 3).eval(), out / "mtp", {"source": "test"})
    src = shared_path("models", "stories260K")
    export_model(src, out / "l1", fuse=False, layers=1, skip_verify=True, progress=False)
    mtp, draft = specport.load(out / "mtp", mtp_branch=True), specport.load(out / "l1")
    eos = stories.manifest.eos_token_ids
    for text in STORY_PROMPTS:
        ids = stories.encode(text)
        plain = stories.generate(prompt_ids=ids, max_new_tokens=60)
        for adaptive in (False, True):  # the greedy MTP fast path, fixed and adaptive K
            got = generate_speculative(
                mtp, ids, 60, "mtp", 3, None, SamplingConfig(), eos, None, adaptive
            )
            assert got[0] == plain.tokens and got[1] == plain.finish_reason, text
        slow = SpeculativeGenerator(
            mtp.session, mtp.manifest, MTPProposer(mtp.manifest), 3, fast=False
        )
        assert slow.generate(ids, 60, eos_ids=eos).tokens == plain.tokens, text
        got = generate_speculative(stories, ids, 60, "draft", 3, draft, SamplingConfig(), eos, None)
        assert got[0] == plain.tokens, text


@pytest.mark.parametrize("adaptive", [False, True])
def test_mtp_fast_path_equals_host_verified_loop(tiny, tiny_mtp, adaptive, monkeypatch):
    """The greedy MTP graph verdict (``verify.GraphVerifier``, no host argmax) changes nothing."""
    from specport.runtime.speculative.mtp import MTPProposer

    model, _ = tiny
    kept = kept_kv(monkeypatch)
    m = tiny_mtp.manifest
    for i, ids in enumerate(_prompts(6, seed=4)):
        budget = 12 + 5 * i
        plain = model.generate(prompt_ids=ids, max_new_tokens=budget, ignore_eos=True)
        eos = [plain.tokens[budget // 2]]  # stop in the middle of some accepted run
        plain_eos = model.generate(prompt_ids=ids, max_new_tokens=budget)
        runs = {}
        for fast in (True, False):
            gen = SpeculativeGenerator(tiny_mtp.session, m, MTPProposer(m), 2, adaptive, fast)
            out = gen.generate(ids, budget)
            assert out.tokens == plain.tokens, (fast, ids)
            assert kept["kv"][0].shape[2] == len(ids) + budget - 1  # cut to what was emitted
            stopped = gen.generate(ids, budget, eos_ids=eos)
            assert stopped.finish_reason == "eos"
            assert stopped.tokens == plain.tokens[: plain.tokens.index(eos[0]) + 1]
            runs[fast] = out.metrics["speculative"]
            assert runs[fast]["adaptive"] is adaptive
        assert plain_eos.tokens  # (the model's own EOS is not necessarily hit)
        assert runs[True]["steps"] == runs[False]["steps"]  # same acceptance, step for step
    # The context window still bounds the fast path.
    ids = _prompts(1, seed=5)[0]
    gen = SpeculativeGenerator(tiny_mtp.session, m, MTPProposer(m), 2, adaptive)
    room = m.context_length - len(ids)
    out = gen.generate(ids, room + 50)
    assert out.finish_reason == "context" and len(out.tokens) == room


@pytest.mark.parametrize("method,k", [("ngram", 4), ("draft", 3)])
def test_adaptive_draft_length_equals_plain(tiny, method, k):
    model, draft = tiny
    for ids in _prompts(6, seed=11):
        plain = model.generate(prompt_ids=ids, max_new_tokens=30, ignore_eos=True)
        toks, _, metrics = generate_speculative(
            model, ids, 30, method, k, draft, SamplingConfig(), (), None, adaptive=True
        )
        assert toks == plain.tokens, (method, ids)
        assert metrics["speculative"]["adaptive"] is True
        assert len(metrics["speculative"]["drafted_per_position"]) <= k


def test_bench_plain_reference_strips_the_mtp_branch(tiny, tiny_mtp):
    """Plain decoding in the bench runs the base graph, not the graph with the heads."""
    from specport.bench.speculative import (
        SpecBenchConfig,
        plain_reference,
        run_speculative_bench,
    )

    model, _ = tiny
    with plain_reference(tiny_mtp, threads=1) as (plain, what):
        assert what.startswith("base graph")
        names = [o.name for o in plain.session.get_outputs()]
        assert names == [o.name for o in model.session.get_outputs()]
        ids = _prompts(1, seed=2)[0]
        assert (
            plain.generate(prompt_ids=ids, max_new_tokens=10).tokens
            == model.generate(prompt_ids=ids, max_new_tokens=10).tokens
        )
    with plain_reference(model) as (same, what):
        assert same is model and what == "same artifact"
    report = run_speculative_bench(
        str(tiny_mtp.path),
        SpecBenchConfig(
            methods=["mtp"],
            num_draft=2,
            prompt_ids=_prompts(2),
            max_new_tokens=10,
            runs=1,
            threads=1,
            adaptive="both",
        ),
    )
    assert report["plain"].startswith("base graph")
    rows = {r["engine"]: r for r in report["rows"]}
    assert set(rows) == {"plain", "mtp", "mtp+adaptive"}
    assert all(r["tokens_equal_plain"] for r in rows.values())
    with pytest.raises(InputError, match="--adaptive"):
        run_speculative_bench(
            str(tiny_mtp.path), SpecBenchConfig(methods=["mtp"], prompt_ids=[[3, 4]], adaptive="x")
        )
