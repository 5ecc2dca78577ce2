"""Whole-model fusion: parity with the unfused graph, greedy decoding, op-level promises."""

from __future__ import annotations

import numpy as np
import pytest

from specport.core.errors import PassError
from specport.passes.base import op_counts
from specport.passes.pipelines import optimize_model, pipeline_for
from tests.passes.graph_models import cpu_session, kv_dims, make_feeds

ARCHS = ["llama", "qwen2", "qwen3", "mistral", "phi3", "gemma", "gpt2"]
CASES = [(5, 0, [0, 2]), (1, 6, [0, 3]), (3, 4, [0, 1])]  # (S, P, left pads) with batch 2


def _parity(base, fused, dims, vocab):
    worst = 0.0
    for s, p, pads in CASES:
        feeds = make_feeds(dims, 2, s, p, vocab, left_pad=pads)
        a, b = base.run(None, feeds), fused.run(None, feeds)
        real = feeds["attention_mask"][:, p:] == 1
        worst = max(worst, float(np.abs(a[0] - b[0]).max(-1)[real].max()))
        kv_real = feeds["attention_mask"][:, None, :, None] == 1
        for x, y in zip(a[1:], b[1:]):
            worst = max(worst, float(np.abs(np.where(kv_real, x - y, 0)).max()))
    return worst


def _greedy(sess, dims, vocab, steps=8):
    """Greedy decode from a left-padded batch of 2 prompts; returns the generated ids."""
    feeds = make_feeds(dims, 2, 6, 0, vocab, left_pad=[0, 2], seed=3)
    mask, pos = feeds["attention_mask"], feeds["position_ids"]
    out = []
    for _ in range(steps):
        res = sess.run(None, feeds)
        nxt = res[0][:, -1].argmax(-1)
        out.append(nxt)
        feeds = {"input_ids": nxt[:, None].astype(np.int64)}
        mask = np.concatenate([mask, np.ones((2, 1), np.int64)], 1)
        pos = pos[:, -1:] + 1
        feeds["attention_mask"], feeds["position_ids"] = mask, pos
        for i in range(dims[0]):
            feeds[f"past_key_values.{i}.key"] = res[1 + 2 * i]
            feeds[f"past_key_values.{i}.value"] = res[2 + 2 * i]
    return np.stack(out, 1)


def test_llama_cpu_fuses_everything(tiny_export, tmp_path):
    model, path = tiny_export("llama")
    fused, report = optimize_model(path, "cpu")
    counts = op_counts(fused)
    assert counts["com.microsoft.GroupQueryAttention"] == 2
    assert "If" not in counts
    assert counts["com.microsoft.SkipSimplifiedLayerNormalization"] == 4
    assert (
        "Attention" not in counts and counts["RMSNormalization"] == 1
    )  # layer-0 input norm (no residual before it)
    names = [p["name"] for p in report["passes"]]
    assert names == pipeline_for("cpu").names()
    attn = next(p for p in report["passes"] if p["name"] == "fuse_attention")
    assert attn["matched"] == 2 and attn["fused"][0]["kv_num_heads"] == 2
    sess = cpu_session(fused, tmp_path)
    assert [i.name for i in sess.get_inputs()] == [i.name for i in cpu_session(path).get_inputs()]
    dims = kv_dims(model)
    assert _parity(cpu_session(path), sess, dims, model.config.vocab_size) < 1e-4


def test_no_softmax_on_decode_path(tiny_export):
    """Every attention is the fused kernel in the main graph: no Softmax, no If anywhere."""
    _, path = tiny_export("llama")
    fused, _ = optimize_model(path, "cpu")
    counts = op_counts(fused)
    assert "Softmax" not in counts and "If" not in counts
    assert counts["com.microsoft.GroupQueryAttention"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("target", ["neutral", "cpu", "cann"])
def test_parity_and_greedy(tiny_export, tmp_path, arch, target):
    model, path = tiny_export(arch)
    fused, report = optimize_model(path, target)
    dims, vocab = kv_dims(model), model.config.vocab_size
    base, sess = cpu_session(path), cpu_session(fused, tmp_path)
    assert _parity(base, sess, dims, vocab) < 1e-4
    np.testing.assert_array_equal(_greedy(base, dims, vocab), _greedy(sess, dims, vocab))
    attn = next(p for p in report["passes"] if p["name"] == "fuse_attention")
    assert attn["matched"] == dims[0], attn
    if target == "cann":
        lower = report["passes"][-2]
        assert lower["cann"]["ok"], lower["cann"]
    if target == "neutral":
        assert all(k[0] == "specport" for k in fused.functions)


def test_sliding_window_detected(tiny_export):
    """Mistral's window is read from the exported mask (kv_idx > q_idx - W)."""
    _, path = tiny_export("mistral")
    _, report = optimize_model(path, "cpu")
    attn = next(p for p in report["passes"] if p["name"] == "fuse_attention")
    assert [f["sliding_window"] for f in attn["fused"]] == [4096, 4096]
    assert attn["fused"][0]["window_source"].startswith("detected")


@pytest.mark.slow
def test_cropped_sliding_cache(tiny_export, tmp_path):
    """A window shorter than the traced past: HF crops the cache to W-1 before the Concat; the
    fused graph keeps that (present length W-1+S) and matches the unfused logits."""
    model, path = tiny_export("mistral", sliding_window=3)
    fused, report = optimize_model(path, "cpu")
    attn = next(p for p in report["passes"] if p["name"] == "fuse_attention")
    assert attn["matched"] == 2 and attn["fused"][0]["cropped_past"]
    assert attn["fused"][0]["sliding_window"] == 3
    base, sess = cpu_session(path), cpu_session(fused, tmp_path)
    for s, p in [(1, 2), (1, 5), (2, 4)]:
        feeds = make_feeds(kv_dims(model), 1, s, p, model.config.vocab_size)
        a, b = base.run(None, feeds), sess.run(None, feeds)
        assert a[1].shape == b[1].shape
        assert np.abs(a[0] - b[0]).max() < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_torchscript_graph_fuses(tiny_export, tmp_path, arch):
    model, path = tiny_export(arch, dynamo=False)
    fused, report = optimize_model(path, "cpu")
    counts = op_counts(fused)
    key = (
        "com.microsoft.SkipSimplifiedLayerNormalization"
        if arch == "llama"
        else "LayerNormalization"
    )
    assert counts.get(key, 0) >= 3
    attn = next(p for p in report["passes"] if p["name"] == "fuse_attention")
    dims, vocab = kv_dims(model), model.config.vocab_size
    assert attn["decomposed"]["matched"] == dims[0]  # MatMul/Softmax -> Attention-23
    assert attn["matched"] == dims[0] and attn["softmax_left"] == 0  # -> GroupQueryAttention
    assert _parity(cpu_session(path), cpu_session(fused, tmp_path), dims, vocab) < 1e-4


def test_neutral_runs_in_bare_session(tiny_export, tmp_path):
    model, path = tiny_export("llama")
    fused, _ = optimize_model(path, "neutral")
    counts = op_counts(fused)
    assert counts["specport.GroupQueryAttention"] == 2
    assert {k[1] for k in fused.functions} >= {"GroupQueryAttention", "SkipRMSNorm"}
    sess = cpu_session(fused, tmp_path)
    feeds = make_feeds(kv_dims(model), 1, 4, 0, model.config.vocab_size)
    assert np.isfinite(sess.run(None, feeds)[0]).all()


def test_pass_subset_and_errors(tiny_export):
    _, path = tiny_export("llama")
    fused, report = optimize_model(path, "cpu", passes=["fuse_rms_norm"])
    assert [p["name"] for p in report["passes"]] == ["normalize", "fuse_rms_norm", "lower"]
    assert "Attention" in op_counts(fused)
    with pytest.raises(PassError, match="unknown pass"):
        pipeline_for("cpu", ["fuse_everything"])
    with pytest.raises(PassError, match="unknown target"):
        pipeline_for("tpu")
