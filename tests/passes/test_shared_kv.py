"""The shared KV layout: one preallocated buffer per layer, ragged rows via seqlens_k."""

from __future__ import annotations

import numpy as np
import pytest

from specport.errors import PassError
from specport.passes.io_contract import fused_io_contract, kv_layout_fields
from specport.passes.pipelines import optimize_model, pipeline_for
from specport.passes.testing import cpu_session, kv_dims, make_feeds

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
