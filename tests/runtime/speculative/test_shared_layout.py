"""Speculative decoding on the shared (in-place) KV layout: the same guarantees as on concat.

Every proposer (n-gram, draft model, MTP heads) x every layout: greedy output equals plain
greedy token for token; sampling stays lossless (the joint law of the first two sampled tokens
matches the target's); a rejected draft is rolled back by the sequence length alone - the
bound buffers are never replaced or copied, and what they hold for the kept positions equals a
fresh prefill of the same tokens.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from specport.runtime.kv.cache import SharedKVCache
from specport.runtime.kv.concat_cache import ConcatKVCache
from specport.runtime.kv.seq_cache import open_cache
from specport.runtime.sampler import Sampler, SamplingConfig
from specport.runtime.speculative.loop import SpeculativeGenerator, generate_speculative
from tests.runtime.speculative.helpers import RandomProposer

pytestmark = pytest.mark.slow  # exports four tiny artifacts (~20-60 s)

MAX_LENGTH = 96


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        base = rng.integers(3, 256, size=int(rng.integers(1, 10))).tolist()
        out.append(base * (1 + i % 3))  # some prompts repeat themselves: n-gram hits
    return out


@pytest.fixture(scope="module")
def arts(tmp_path_factory) -> dict[str, object]:
    import specport
    from tests.export_cache import cached_export, cached_mtp
    from tests.fixtures import build_tiny_model

    tmp: Path = tmp_path_factory.mktemp("spec_shared")
    src = build_tiny_model("llama", tmp / "src")
    kw = dict(skip_verify=True, progress=False)
    cached_export(src, tmp / "shared", kv_layout="shared", max_length=MAX_LENGTH, **kw)
    cached_export(src, tmp / "draft", kv_layout="shared", max_length=MAX_LENGTH, layers=1, **kw)
    cached_export(src, tmp / "concat", kv_layout="concat", **kw)
    out = {name: specport.load(tmp / name, threads=1) for name in ("shared", "draft", "concat")}
    for layout in ("shared", "concat"):
        cached_mtp(tmp / layout, tmp / f"mtp_{layout}", heads=2, seed=0)
        out[f"mtp_{layout}"] = specport.load(tmp / f"mtp_{layout}", threads=1, mtp_branch=True)
    return out


@pytest.mark.parametrize("layout", ["shared", "concat"])
@pytest.mark.parametrize("method", ["ngram", "draft", "mtp"])
def test_greedy_equals_plain_every_method_and_layout(arts, layout, method):
    model = arts[layout]
    spec = arts[f"mtp_{layout}"] if method == "mtp" else model
    assert spec.manifest.kv.layout == layout
    for ids in _prompts(6, seed=1):
        plain = model.generate(prompt_ids=ids, max_new_tokens=24, ignore_eos=True).tokens
        for k in (1, 2) if method == "mtp" else (1, 4):
            for adaptive in (False, True):
                toks, reason, metrics = generate_speculative(
                    spec, ids, 24, method, k, arts["draft"], SamplingConfig(), (), None, adaptive
                )
                assert toks == plain, (method, layout, k, adaptive, ids)
                assert reason == "length" and metrics["kv_layout"] == layout
                if method != "ngram" and not adaptive:  # (adaptive: only where drafts pay)
                    assert metrics["speculative"]["drafted"] > 0


def test_shared_mtp_verifies_and_drafts_in_one_run(arts):
    """The MTP branch on the shared graph: one bound run gives accepted, bonus and new drafts."""
    mtp = arts["mtp_shared"]
    outs = [o.name for o in mtp.session.get_outputs()]
    assert outs[-3:] == ["mtp_accepted", "mtp_bonus", "mtp_drafts"]
    assert "logits_index" in {i.name for i in mtp.session.get_inputs()}
    cache = open_cache(mtp.session, mtp.manifest, 64)
    assert isinstance(cache.bound, SharedKVCache)
    ids = [5, 17, 42, 9]
    first = cache.step(ids, last_only=True)  # a prefill selects the last position only
    bonus = int(first.outputs["mtp_bonus"][0])
    assert bonus == int(np.argmax(first.logits[-1]))
    drafts = first.outputs["mtp_drafts"][0].tolist()
    assert len(drafts) == 2
    step = cache.step([bonus, *drafts])  # verify: every position selected
    best = np.argmax(step.logits, axis=-1).tolist()
    accepted = 0
    while accepted < 2 and drafts[accepted] == best[accepted]:
        accepted += 1
    assert int(step.outputs["mtp_accepted"][0]) == accepted
    assert int(step.outputs["mtp_bonus"][0]) == best[accepted]


def test_rollback_moves_lengths_and_copies_nothing(arts):
    model = arts["shared"]
    ids = _prompts(2, seed=5)[1]
    gen = SpeculativeGenerator(model.session, model.manifest, RandomProposer(), 4)
    out = gen.generate(ids, 20)
    plain = model.generate(prompt_ids=ids, max_new_tokens=20, ignore_eos=True)
    assert out.tokens == plain.tokens
    assert out.stats.num_accepted_tokens < out.stats.num_draft_tokens  # rejections happened
    cache = gen.last_kv  # the one step's KV interface, a batch of one (engine.driver)
    assert isinstance(cache, SharedKVCache) and cache.rows == 1
    # every binding made along the way wraps views of the same buffers: nothing was replaced
    for bound in [*cache._row.values(), *cache._batch.values()]:
        assert all(
            np.shares_memory(ov.numpy(), buf) for ov, buf in zip(bound.kv._ortvalues, cache.buffers)
        )
    seq = ids + out.tokens[:-1]  # what the last step kept (the row is freed when it ends)
    fresh = open_cache(model.session, model.manifest, 64)
    fresh.step(seq, last_only=True)
    for got, want in zip(cache.buffers, fresh.bound.kv.buffers):  # type: ignore[union-attr]
        np.testing.assert_allclose(got[:, :, : len(seq)], want[:, :, : len(seq)], atol=1e-5)
    again = gen.generate(ids, 20)  # a second generation reuses the same buffers
    assert again.tokens != [] and gen.last_kv is cache


def test_concat_cache_keeps_a_prefix(arts):
    """A concat row cut back to 3 positions goes on as if only those were ever fed."""
    model = arts["concat"]
    cache = open_cache(model.session, model.manifest)
    assert isinstance(cache.bound, ConcatKVCache) and cache.capacity is None
    cache.step([5, 6, 7, 8, 9])
    cache.keep(3)
    assert cache.length == 3
    got = np.array(cache.step([40, 41]).logits)
    want = open_cache(model.session, model.manifest).step([5, 6, 7, 40, 41]).logits[-2:]
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert cache.length == 5


@pytest.mark.parametrize("method", ["draft", "mtp"])
def test_sampling_on_shared_is_lossless(arts, method):
    """Joint law of the first two sampled tokens equals the target's, over many seeds."""
    model = arts["shared"]
    spec = arts["mtp_shared"] if method == "mtp" else model
    ids = [5, 17, 42]
    cfg = dict(greedy=False, temperature=1.0, top_k=3)
    sampler = Sampler(SamplingConfig(**cfg), model.manifest.vocab_size)

    def last_probs(seq: list[int]) -> np.ndarray:
        cache = open_cache(model.session, model.manifest, 16)
        return sampler.probs(cache.step(seq, last_only=True).logits)[0]

    p1 = last_probs(ids)
    expected: dict[tuple[int, int], float] = {}
    for t1 in np.flatnonzero(p1):
        p2 = last_probs([*ids, int(t1)])
        for t2 in np.flatnonzero(p2):
            expected[(int(t1), int(t2))] = p1[t1] * p2[t2]
    n = 1200
    counts: Counter[tuple[int, int]] = Counter()
    drafted = 0
    for seed in range(n):
        toks, _, metrics = generate_speculative(
            spec, ids, 3, method, 2, arts["draft"], SamplingConfig(**cfg, seed=seed), (), None
        )
        counts[(toks[0], toks[1])] += 1
        drafted += metrics["speculative"]["drafted"]
    assert drafted > n // 10  # the drafts really went through rejection sampling
    assert set(counts) <= set(expected)
    tv = 0.5 * sum(abs(counts[c] / n - p) for c, p in expected.items())
    assert tv < 0.07, (tv, counts, expected)


def test_seeded_sampling_repeats_on_shared(arts):
    model = arts["shared"]
    cfg = SamplingConfig(greedy=False, temperature=0.8, seed=11)
    a = generate_speculative(model, [5, 6, 7], 16, "draft", 3, arts["draft"], cfg, (), None)[0]
    b = generate_speculative(model, [5, 6, 7], 16, "draft", 3, arts["draft"], cfg, (), None)[0]
    assert a == b and len(a) == 16


def test_mtp_draft_vocabulary_drafts_only_its_tokens_and_stays_exact(arts, tmp_path):
    """Heads that score a draft vocabulary: the graph's drafts are the torch heads' drafts
    mapped to token ids (all inside the vocabulary), and greedy MTP output equals plain."""
    import torch

    import specport
    from specport.exporter.mtp_artifact import write_mtp_artifact
    from specport.exporter.mtp_heads import MTPHeads
    from specport.train.mtp_train import load_base

    model = arts["shared"]
    base = load_base(model.manifest)  # type: ignore[attr-defined]
    torch.manual_seed(0)
    vocab = torch.arange(3, 67)
    heads = MTPHeads(base, 2, draft_vocab=vocab).eval()
    write_mtp_artifact(model.path, heads, tmp_path / "mtp", {"source": "test"})  # type: ignore[attr-defined]
    mtp = specport.load(tmp_path / "mtp", threads=1, mtp_branch=True)
    ids = [5, 17, 42, 9, 100, 7]
    cache = open_cache(mtp.session, mtp.manifest, 64)
    first = cache.step(ids, last_only=True)
    drafts = first.outputs["mtp_drafts"][0].tolist()
    with torch.no_grad():
        h = base.model(input_ids=torch.tensor([ids])).last_hidden_state[:, -1:]
        tok = torch.tensor([[int(first.outputs["mtp_bonus"][0])]])
        want = []
        for k in range(2):
            h, logits = heads.step(k, h, tok)
            tok = heads.to_vocab(logits.argmax(-1))
            want.append(int(tok))
    assert drafts == want and all(3 <= d < 67 for d in drafts)
    for prompt in _prompts(4, seed=2):
        plain = model.generate(prompt_ids=prompt, max_new_tokens=20, ignore_eos=True).tokens  # type: ignore[attr-defined]
        toks, _, _ = generate_speculative(
            mtp, prompt, 20, "mtp", 2, None, SamplingConfig(), (), None
        )
        assert toks == plain


def _drafting(monkeypatch, share: bool) -> list[tuple[int, bool]]:
    """Record, at every draft-model propose, the context it fed before drafting and whether
    its cache is the target's; ``share=False`` keeps every draft in its own cache."""
    from specport.runtime.speculative.draft import DraftModelProposer

    seen: list[tuple[int, bool]] = []
    real = DraftModelProposer.propose

    def propose(self, context, num_draft):
        drafts = real(self, context, num_draft)
        seen.append((self.caught_up, self._target is not None))
        return drafts

    monkeypatch.setattr(DraftModelProposer, "propose", propose)
    if not share:
        monkeypatch.setattr(DraftModelProposer, "share_target_kv", lambda self, cache, row: False)
    return seen


def test_a_draft_cut_from_the_target_drafts_in_the_targets_cache(arts, monkeypatch):
    """A draft made of the target's first layers runs in the target's KV row: it never reads
    the prompt (one or two tokens per propose, the bonus and its last draft), holds no KV of
    its own, and drafts what it drafts reading everything itself (same accepted counts)."""
    model, draft = arts["shared"], arts["draft"]
    runs = {}
    for share in (True, False):
        with monkeypatch.context() as patch:
            seen = _drafting(patch, share)
            for ids in _prompts(6, seed=2):
                plain = model.generate(prompt_ids=ids, max_new_tokens=20, ignore_eos=True).tokens
                toks, _, metrics = generate_speculative(
                    model, ids, 20, "draft", 3, draft, SamplingConfig(), (), None, False
                )
                assert toks == plain, (share, ids)
                spec = metrics["speculative"]
                runs.setdefault(share, []).append((spec["drafted"], spec["accepted"]))
        assert seen and all(shared == share for _, shared in seen)
        if share:
            assert max(fed for fed, _ in seen) <= 2  # the prompt was never fed to the draft
        else:
            assert max(fed for fed, _ in seen) > 2  # its own cache: it read the prompt
    assert runs[True] == runs[False]


def test_a_draft_from_another_source_keeps_its_own_cache(arts):
    import dataclasses

    from specport.runtime.kv.cache import open_kv_cache
    from specport.runtime.speculative.draft import DraftModelProposer, first_layers_of

    model, draft = arts["shared"], arts["draft"]
    target = open_kv_cache(model.session, model.manifest, 1, MAX_LENGTH)
    assert first_layers_of(model.manifest, draft.manifest)
    assert not first_layers_of(draft.manifest, model.manifest)  # more layers than its target
    assert not first_layers_of(arts["concat"].manifest, draft.manifest)  # no buffers to share
    other = dataclasses.replace(draft.manifest, source={**draft.manifest.source, "path": "/x"})
    proposer = DraftModelProposer(draft.session, other, model.manifest.vocab_size)
    assert not first_layers_of(model.manifest, other)
    assert proposer.share_target_kv(target, 0) is False
    own = DraftModelProposer(draft.session, draft.manifest, model.manifest.vocab_size)
    assert own.share_target_kv(target, 0) is True
    assert all(np.shares_memory(a, b) for a, b in zip(own.cache.bound.buffers, target.buffers))


def test_a_draft_whose_cache_holds_other_values_keeps_its_own(arts):
    """Sharing needs the draft's cached keys and values to be what the target caches: a W8A8
    draft with SmoothQuant folded into its value projection caches values divided by its
    scales (shared, it drafted 1.10 tokens per step on SmolLM2 against 3.85 with
    `--keep-kv-values`), an int8 cache has its own scales."""
    import dataclasses

    from specport.runtime.kv.cache import open_kv_cache
    from specport.runtime.speculative.draft import DraftModelProposer, first_layers_of

    model, draft = arts["shared"], arts["draft"]
    target = open_kv_cache(model.session, model.manifest, 1, MAX_LENGTH)

    def variant(**quant) -> object:
        return dataclasses.replace(draft.manifest, quant=quant)

    kv8 = dataclasses.replace(draft.manifest.kv, dtype="int8")
    refused = {
        "smoothed": variant(scheme="w8a8", kv_values="smoothed"),
        "w8a8 made before the record": variant(scheme="w8a8"),
        "int8 cache": dataclasses.replace(draft.manifest, kv=kv8),
    }
    for why, manifest in refused.items():
        assert not first_layers_of(model.manifest, manifest), why
        proposer = DraftModelProposer(draft.session, manifest, model.manifest.vocab_size)
        assert proposer.share_target_kv(target, 0) is False, why
    assert first_layers_of(model.manifest, variant(scheme="w8a8", kv_values="source"))
    assert first_layers_of(model.manifest, variant(scheme="w4a8"))


def test_draft_self_is_made_once_kept_and_drafts_in_the_targets_cache(arts, tmp_path, monkeypatch):
    """`draft="self"`: the target's own 4-bit file, quantized on first use into the cache
    folder (never beside the target), reused after, drafting in the target's KV cache; a
    target it cannot be made from is refused before any work."""
    from specport.core.errors import InputError
    from specport.runtime.speculative.draft import first_layers_of

    monkeypatch.setenv("SPECPORT_CACHE", str(tmp_path))
    model = arts["shared"]
    before = sorted(p.name for p in model.path.iterdir())
    draft = model.draft_model("self")
    assert draft.path.parent == tmp_path / "drafts"
    assert draft.manifest.quant["scheme"] == "w4a8" and draft.manifest.quant["float_zero_points"]
    assert first_layers_of(model.manifest, draft.manifest)
    made = (draft.path / "specport.json").stat().st_mtime_ns
    assert model.draft_model("self").path == draft.path
    assert (draft.path / "specport.json").stat().st_mtime_ns == made  # not made again
    assert [p.name for p in (tmp_path / "drafts").iterdir()] == [draft.path.name]
    assert sorted(p.name for p in model.path.iterdir()) == before
    for ids in _prompts(4, seed=3):
        plain = model.generate(prompt_ids=ids, max_new_tokens=16, ignore_eos=True).tokens
        spec = model.generate(
            prompt_ids=ids, max_new_tokens=16, ignore_eos=True, speculative="draft", draft="self"
        )
        assert spec.tokens == plain, ids
    with pytest.raises(InputError, match="already w4a8"):
        draft.draft_model("self")
    with pytest.raises(InputError, match="shared"):
        arts["concat"].draft_model("self")
