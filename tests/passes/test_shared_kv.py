"""The shared KV layout: one preallocated buffer per layer, ragged rows via seqlens_k."""

from __future__ import annotations

import numpy as np
import pytest

from specport.core.errors import PassError
from specport.passes.io_contract import fused_io_contract, kv_layout_fields
from specport.passes.pipelines import optimize_model, pipeline_for
from tests.passes.graph_models import cpu_session, kv_dims, make_feeds

T = 24  # buffer length


def _greedy_concat(sess, dims, prompt, steps):
    feeds = make_feeds(dims, 1, len(prompt), 0, 2)
    feeds["input_ids"] = np.asarray([prompt], np.int64)
    out = []
    for _ in range(steps):
        res = sess.run(None, feeds)
        nxt = int(res[0][0, -1].argmax())
        out.append(nxt)
        n = feeds["attention_mask"].shape[1]
        feeds = {
            "input_ids": np.asarray([[nxt]], np.int64),
            "attention_mask": np.ones((1, n + 1), np.int64),
            "position_ids": np.asarray([[n]], np.int64),
        }
        for i in range(dims[0]):
            feeds[f"past_key_values.{i}.key"] = res[1 + 2 * i]
            feeds[f"past_key_values.{i}.value"] = res[2 + 2 * i]
    return out


def _greedy_shared(sess, dims, prompts, steps):
    """Ragged batch: right-padded prompt, then one token per row per step, in one buffer."""
    n_layers, hkv, hd = dims
    b = len(prompts)
    lens = np.array([len(p) for p in prompts])
    s = int(lens.max())
    ids = np.zeros((b, s), np.int64)
    for r, p in enumerate(prompts):
        ids[r, : len(p)] = p
    cache = {
        f"past_key_values.{i}.{kv}": np.zeros((b, hkv, T, hd), np.float32)
        for i in range(n_layers)
        for kv in ("key", "value")
    }
    feeds = {
        "input_ids": ids,
        "position_ids": np.tile(np.arange(s), (b, 1)),
        "seqlens_k": (lens - 1).astype(np.int32),
        "total_sequence_length": np.array(s, np.int32),
    }
    outs: list[list[int]] = [[] for _ in range(b)]
    for _ in range(steps):
        res = sess.run(None, {**feeds, **cache})
        nxt = res[0][np.arange(b), lens - 1 if not outs[0] else 0].argmax(-1)
        for r in range(b):
            outs[r].append(int(nxt[r]))
        for i in range(n_layers):  # present is the same buffer (the runtime binds it)
            cache[f"past_key_values.{i}.key"] = res[1 + 2 * i]
            cache[f"past_key_values.{i}.value"] = res[2 + 2 * i]
        feeds = {
            "input_ids": nxt[:, None].astype(np.int64),
            "position_ids": lens[:, None].astype(np.int64),
            "seqlens_k": lens.astype(np.int32),
            "total_sequence_length": np.array(lens.max() + 1, np.int32),
        }
        lens = lens + 1
    return outs


def test_shared_layout_matches_concat(tiny_export, tmp_path):
    model, path = tiny_export("llama")
    dims = kv_dims(model)
    shared, report = optimize_model(path, "cpu", kv_layout="shared", max_length=T)
    contract = fused_io_contract(shared)
    assert contract["layout"] == "shared" and contract["max_length"] == T
    assert "attention_mask" not in contract["graph_inputs"]
    assert contract["num_heads"] == [dims[1]] * dims[0]
    assert set(kv_layout_fields(contract)) >= {"layout", "inputs", "max_length"}
    assert report["passes"][-1]["name"] == "shared_kv"
    base = cpu_session(path)
    sess = cpu_session(shared, tmp_path)
    prompts = [[5, 17, 33, 2, 9, 41], [7, 8, 100]]
    got = _greedy_shared(sess, dims, prompts, steps=6)
    for prompt, row in zip(prompts, got):
        assert row == _greedy_concat(base, dims, prompt, steps=6)


def test_concat_contract_and_shared_errors(tiny_export):
    _, path = tiny_export("llama")
    fused, _ = optimize_model(path, "cpu")
    contract = fused_io_contract(fused)
    assert contract["layout"] == "concat" and contract["max_length"] is None
    assert contract["inputs"][0] == ["past_key_values.0.key", "past_key_values.0.value"]
    assert "attention_mask" in contract["feeds"]
    with pytest.raises(PassError, match="shared"):
        pipeline_for("cann", kv_layout="shared")


def _shared_step(sess, dims, ids, lens, cache):
    """One shared-layout run: rows of `ids` [B, S] on top of `lens[b]` cached tokens."""
    feeds = {
        "input_ids": ids,
        "seqlens_k": (lens + ids.shape[1] - 1).astype(np.int32),
        "total_sequence_length": np.array(lens.max() + ids.shape[1], np.int32),
        **cache,
    }
    names = {i.name for i in sess.get_inputs()}
    if "position_ids" in names:
        feeds["position_ids"] = lens[:, None] + np.arange(ids.shape[1])[None]
    res = sess.run(None, {k: v for k, v in feeds.items() if k in names})
    return res[0], {
        f"past_key_values.{i}.{kv}": res[1 + 2 * i + j]
        for i in range(dims[0])
        for j, kv in enumerate(("key", "value"))
    }


@pytest.mark.parametrize(
    "options",
    [{}, {"rotary_length": T, "pack_qkv": True}],
    ids=["plain", "rotary-folded-packed"],
)
def test_shared_batched_multi_token_step_on_a_past(tiny_export, tmp_path, options):
    """Batch 2, three new tokens per row on pasts of 6 and 3 tokens in one run: the fused
    kernel takes it (query_seqlens) and each row's logits equal that row run alone."""
    model, path = tiny_export("llama")
    dims = kv_dims(model)
    shared, _ = optimize_model(path, "cpu", kv_layout="shared", max_length=T, **options)
    sess = cpu_session(shared, tmp_path)
    n_layers, hkv, hd = dims
    prompts = [[5, 17, 33, 2, 9, 41], [7, 8, 100]]
    chunk = np.array([[11, 12, 13], [21, 22, 23]], np.int64)
    caches, singles = [], []
    for r, prompt in enumerate(prompts):
        empty = {
            f"past_key_values.{i}.{kv}": np.zeros((1, hkv, T, hd), np.float32)
            for i in range(n_layers)
            for kv in ("key", "value")
        }
        ids = np.asarray([prompt], np.int64)
        _, cache = _shared_step(sess, dims, ids, np.array([0]), empty)
        caches.append({k: v.copy() for k, v in cache.items()})
        logits, _ = _shared_step(sess, dims, chunk[r : r + 1], np.array([len(prompt)]), cache)
        singles.append(logits[0])
    batch_cache = {k: np.concatenate([c[k] for c in caches]) for k in caches[0]}
    lens = np.array([len(p) for p in prompts])
    logits, _ = _shared_step(sess, dims, chunk, lens, batch_cache)
    assert logits.shape[:2] == (2, 3)
    for r in range(2):
        np.testing.assert_allclose(logits[r], singles[r], atol=1e-5, rtol=0)
