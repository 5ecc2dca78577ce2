"""The runtime on a shared-layout artifact with an int8 KV cache (quantize --kv-cache int8).

The in-place buffers are allocated as int8 from the manifest (a quarter of the fp32 bytes);
plain generation, speculative decoding with every proposer (n-gram, draft model, MTP heads) and
the batching engine run on them, and greedy speculative output equals plain greedy of the same
int8 artifact token for token (GroupQueryAttention reads every position through the int8
cache, so logits do not depend on how many tokens a run appends).
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from specport.runtime.engine.base import Request
from specport.runtime.engine.batching import BatchingEngine
from specport.runtime.kv.layouts import SharedKV
from specport.runtime.sampler import SamplingConfig
from specport.runtime.speculative.loop import generate_speculative

pytestmark = pytest.mark.slow  # exports and quantizes three tiny artifacts (~30 s)

MAX_LENGTH = 96


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        base = rng.integers(3, 256, size=int(rng.integers(1, 9))).tolist()
        out.append(base * (1 + i % 3))  # some prompts repeat themselves: n-gram hits
    return out


@pytest.fixture(scope="module")
def arts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:

    import specport
    from specport.passes.quant.apply import quantize_artifact
    from tests.export_cache import cached_export, cached_mtp
    from tests.fixtures import TINY, make_llama
    from tests.passes.quant._tiny import write_corpus

    tmp: Path = tmp_path_factory.mktemp("kv8_runtime")
    hf = make_llama(tmp / "hf", context_length=128, initializer_range=0.2, **TINY)  # type: ignore[arg-type]
    kw = dict(skip_verify=True, progress=False, kv_layout="shared", max_length=MAX_LENGTH)
    cached_export(hf, tmp / "fp32", **kw)
    cached_export(hf, tmp / "draft", layers=1, **kw)
    cached_export(hf, tmp / "tree", tree_mask=True, **kw)
    fp32 = specport.load(tmp / "fp32", threads=1)
    cached_mtp(tmp / "fp32", tmp / "mtp")
    calib = [write_corpus(tmp / "calib.txt", docs=16)]
    for name in ("fp32", "mtp", "tree"):
        quantize_artifact(
            tmp / name, tmp / f"{name}_kv8", "none", kv_cache="int8", calib_files=calib
        )
    quantize_artifact(  # layer 1 keeps a float32 cache, layer 0 is int8
        tmp / "fp32", tmp / "mixed", "none", kv_cache="int8", calib_files=calib, kv_float_layers=[1]
    )
    return {
        "mixed": specport.load(tmp / "mixed", threads=1),
        "fp32": fp32,
        "kv8": specport.load(tmp / "fp32_kv8", threads=1),
        "mtp_kv8": specport.load(tmp / "mtp_kv8", threads=1, mtp_branch=True),
        "draft": specport.load(tmp / "draft", threads=1),
        "tree_kv8": specport.load(tmp / "tree_kv8", threads=1),
    }


def test_buffers_are_int8_and_a_quarter_of_fp32(arts):
    kv8, fp32 = arts["kv8"].manifest, arts["fp32"].manifest
    assert kv8.kv.layout == "shared" and kv8.kv.dtype == "int8"
    q, f = SharedKV(kv8, 2, 64), SharedKV(fp32, 2, 64)
    assert {b.dtype for b in q.buffers} == {np.dtype(np.int8)}
    assert sum(b.nbytes for b in f.buffers) == 4 * sum(b.nbytes for b in q.buffers)


def test_long_prompt_prefill_in_chunks_matches_one_run(arts, monkeypatch):
    """A prompt longer than twice INT8_CHUNK is prefilled in chunks on an int8 cache: the same
    last logits and cache bytes as one run, and the same greedy tokens."""
    from specport.runtime.kv import iobinding
    from specport.runtime.kv.iobinding import BoundSession

    model = arts["kv8"]
    ids = np.array(_prompts(1, seed=5)[0] * 12, np.int64)[:40][None, :]
    runs = {}
    for chunk in (1000, 8):  # one run; 5 runs of 8
        monkeypatch.setattr(iobinding, "INT8_CHUNK", chunk)
        bound = BoundSession(model.session, model.manifest, 1, 64)
        logits, _ = bound.prefill(ids, np.array([40]))
        runs[chunk] = (logits.copy(), [b.copy() for b in bound.kv.buffers], bound.kv.lengths.copy())
        tokens = model.generate(prompt_ids=ids[0].tolist(), max_new_tokens=8, ignore_eos=True)
        runs[chunk] += (tokens.tokens,)
    (l1, b1, n1, t1), (l8, b8, n8, t8) = runs[1000], runs[8]
    np.testing.assert_allclose(l8, l1, atol=1e-5, rtol=1e-5)
    assert n1.tolist() == n8.tolist() == [40] and t1 == t8
    for x, y in zip(b1, b8):
        assert np.array_equal(x[:, :, :40], y[:, :, :40])


def test_batching_engine_prefills_int8_rows_together(arts, monkeypatch):
    """Prompts arriving together prefill in one run on the int8 cache (empty rows, then a
    prefix hit beside fresh rows) and every answer equals its own plain greedy."""
    model = arts["kv8"]
    prompts = _prompts(6, seed=9)
    want = [
        model.generate(prompt_ids=p, max_new_tokens=12, ignore_eos=True).tokens for p in prompts
    ]
    gate = threading.Event()
    take = BatchingEngine._take

    def gated(self, block):  # the worker waits for the gate after each take: arrivals meet
        more = take(self, block)
        assert gate.wait(60)
        return more and take(self, False)

    monkeypatch.setattr(BatchingEngine, "_take", gated)
    eng = BatchingEngine(model, max_batch=8)
    try:
        handles = [eng.submit(Request(p, 12, ignore_eos=True)) for p in prompts[:3]]
        gate.set()
        assert [h.result(timeout=60).token_ids for h in handles] == want[:3]
        runs = eng.stats()["prefill_runs"]
        assert runs < 3  # (split where one run's padding would cost more than a run)
        follow = prompts[0] + want[0][:4] + [7]
        gate.clear()
        handles = [eng.submit(Request(p, 12, ignore_eos=True)) for p in [follow, *prompts[3:]]]
        gate.set()
        got = [h.result(timeout=60).token_ids for h in handles]
        assert got[1:] == want[3:]
        assert (
            got[0] == model.generate(prompt_ids=follow, max_new_tokens=12, ignore_eos=True).tokens
        )
        stats = eng.stats()
        assert stats["prefix_cache_hits"] >= 1 and stats["errors"] == 0
        assert stats["prefill_runs"] - runs < len(handles)
    finally:
        gate.set()
        eng.close()


@pytest.mark.parametrize("method", ["ngram", "draft", "mtp"])
def test_speculative_greedy_equals_plain_greedy_of_the_int8_artifact(arts, method):
    model = arts["mtp_kv8"] if method == "mtp" else arts["kv8"]
    drafted = 0
    for ids in _prompts(5, seed=1):
        plain = model.generate(prompt_ids=ids, max_new_tokens=24, ignore_eos=True).tokens
        assert len(plain) == 24
        for k in (1, 2) if method == "mtp" else (1, 4):
            for adaptive in (False, True):
                toks, reason, metrics = generate_speculative(
                    model, ids, 24, method, k, arts["draft"], SamplingConfig(), (), None, adaptive
                )
                assert toks == plain, (method, k, adaptive, ids)
                assert reason == "length" and metrics["kv_layout"] == "shared"
                drafted += metrics["speculative"]["drafted"]
    assert drafted > 0


def test_token_tree_on_int8_equals_plain_greedy(arts):
    """A --tree-mask shared artifact: the tree goes to GroupQueryAttention as attention_bias,
    which the int8 cache path honours too."""
    model = arts["tree_kv8"]
    assert model.manifest.kv.layout == "shared" and model.manifest.kv.dtype == "int8"
    drafted = 0
    for ids in _prompts(4, seed=4):
        plain = model.generate(prompt_ids=ids, max_new_tokens=20, ignore_eos=True).tokens
        for width in (2, 3):
            tree = model.generate(
                prompt_ids=ids, max_new_tokens=20, ignore_eos=True, speculative="ngram",
                tree_width=width,
            )  # fmt: skip
            assert tree.tokens == plain, (width, ids)
            spec = tree.metrics["speculative"]
            assert spec["method"] == "ngram-tree" and spec["tree_width"] == width
            drafted += spec["drafted"]
    assert drafted > 0


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_batching_engine_speculating_on_int8_equals_plain_greedy(arts, method):
    model = arts["kv8"]
    prompts, new = _prompts(5, seed=3), [20, 16, 24, 12, 18]
    want = [
        model.generate(prompt_ids=p, max_new_tokens=n, ignore_eos=True).tokens
        for p, n in zip(prompts, new)
    ]
    eng = BatchingEngine(
        model,
        max_batch=3,
        prefill_chunk=4,
        speculative=method,
        draft=arts["draft"],
        spec_max_rows=8,
    )
    try:
        first = eng.submit(Request(prompts[0], new[0], ignore_eos=True))
        events = first.events(timeout=60)
        head = next(events)
        doomed = eng.submit(Request(prompts[2], 60, ignore_eos=True))
        rest = [eng.submit(Request(prompts[i], new[i], ignore_eos=True)) for i in (1, 3, 4)]
        next(doomed.events(timeout=60))
        doomed.cancel()
        assert [t for ev in [head, *events] for t in ev.token_ids] == want[0]
        for i, handle in zip((1, 3, 4), rest):
            assert handle.result(timeout=60).token_ids == want[i], i
        stats = eng.stats()
        assert stats["errors"] == 0 and stats["spec_steps"] > 0
    finally:
        eng.close()


def test_mixed_layer_dtypes_buffers_speculation_and_engine(arts):
    """int8 in layer 0, float32 in layer 1 (`--kv-float-layers 1`): each buffer in its layer's
    dtype, and greedy speculation (chain, adaptive, batching engine) equals plain greedy."""
    model = arts["mixed"]
    kv = model.manifest.kv
    assert kv.dtype == "int8" and kv.layer_dtypes == ["int8", "float32"]
    state = SharedKV(model.manifest, 2, 64)
    assert [b.dtype for b in state.buffers] == [np.dtype(np.int8)] * 2 + [np.dtype(np.float32)] * 2
    drafted = 0
    prompts = _prompts(4, seed=6)
    want = [
        model.generate(prompt_ids=p, max_new_tokens=20, ignore_eos=True).tokens for p in prompts
    ]
    for ids, plain in zip(prompts, want):
        for method in ("ngram", "draft"):
            for adaptive in (False, True):
                toks, _, metrics = generate_speculative(
                    model, ids, 20, method, 4, arts["draft"], SamplingConfig(), (), None, adaptive
                )
                assert toks == plain, (method, adaptive, ids)
                drafted += metrics["speculative"]["drafted"]
    assert drafted > 0
    eng = BatchingEngine(model, max_batch=2, prefill_chunk=4, speculative="ngram", spec_max_rows=8)
    try:
        handles = [eng.submit(Request(p, 20, ignore_eos=True)) for p in prompts]
        got = [h.result(timeout=120).token_ids for h in handles]
    finally:
        eng.close()
    assert got == want
