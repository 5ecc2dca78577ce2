"""The EAGLE draft head as the exporter writes it: the target's feature output, the head's
decode with a KV cache against its training-time test, and the draft graph (torch export and
the fused one) against the head. Training it is tested in tests/train/test_eagle_train.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest
import torch

from specport.core.contract import EAGLE_FEATURES
from specport.exporter.eagle_head import EagleHead
from specport.passes.eagle_features import ExposeEagleFeaturesPass, feature_layers
from specport.train.eagle_objective import ttt_loss
from tests.fixtures import eagle_config, tiny_eagle_head

CFG = eagle_config()


def test_feature_output_leaves_logits_unchanged(tiny_llama_artifact, tmp_path):
    import onnxruntime as ort

    from specport.artifact import manifest as art
    from specport.exporter.eagle_artifact import copy_with_features
    from specport.runtime.kv.seq_cache import open_cache

    manifest = art.read_manifest(tiny_llama_artifact)
    new, report = copy_with_features(tiny_llama_artifact, tmp_path / "a", manifest)
    assert report["layers"] == [*feature_layers(manifest.num_layers), "final_norm"]
    assert EAGLE_FEATURES in {o["name"] for o in new.io["outputs"]}
    model = ir.load(str(tmp_path / "a" / manifest.model_file))
    assert not ExposeEagleFeaturesPass(manifest.num_layers)(model).modified  # already there

    featured = ort.InferenceSession(str(tmp_path / "a" / manifest.model_file))
    plain = ort.InferenceSession(str(tiny_llama_artifact / manifest.model_file))
    ids = [1, 5, 9, 40, 7, 3]
    a = open_cache(plain, manifest).step(ids)
    b = open_cache(featured, manifest).step(ids)
    np.testing.assert_array_equal(a.logits, b.logits)
    hidden = int(manifest.config["hidden_size"])
    assert b.outputs[EAGLE_FEATURES].shape == (1, len(ids), 3 * hidden)


def test_head_with_kv_computes_what_training_time_test_trains():
    """Drafting from origin 5 with the head's KV (depth 0, then its own hidden output at
    depths 1 and 2) gives the logits the training-time test scores at those depths."""
    head = tiny_eagle_head()
    t = 10
    feats = torch.randn(1, t, 96)
    ids = torch.randint(0, 50, (1, t))
    seen = []
    logits = head.logits
    head.logits = lambda g: seen.append(logits(g)) or seen[-1]  # type: ignore[method-assign]
    with torch.no_grad():
        ttt_loss(head, feats, ids, torch.zeros(1, t, dtype=torch.long), 3)
    head.logits = logits  # type: ignore[method-assign]
    with torch.no_grad():
        empty = torch.zeros(1, 2, 0, 8)
        _, l0, g, k, v = head(ids[:, :6], feats[:, :6], torch.zeros(1, 6, 32), empty, empty)
        _, l1, g, k, v = head(ids[:, 6:7], torch.zeros(1, 1, 96), g[:, -1:], k, v)
        _, l2, _, _, _ = head(ids[:, 7:8], torch.zeros(1, 1, 96), g[:, -1:], k, v)
    # depth j scores positions j..T-1 (masked rows dropped): position t is row t - j
    torch.testing.assert_close(seen[0][5], l0[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(seen[1][6 - 1], l1[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(seen[2][7 - 2], l2[0], atol=1e-5, rtol=0)


def _write_torch_export(head: EagleHead, path: Path) -> None:
    from specport.exporter.eagle_artifact import export_draft

    export_draft(head, path)


def _write_fused(head: EagleHead, path: Path) -> None:
    import onnx

    from specport.exporter.eagle_graph import fused_draft_graph

    onnx.save(fused_draft_graph(head, max_positions=32), str(path))


@pytest.mark.parametrize("write", [_write_torch_export, _write_fused], ids=["torch", "fused"])
@pytest.mark.parametrize(
    "batch,new,past",
    [(1, 3, 0), (1, 1, 0), (1, 1, 5), (1, 4, 6), (3, 1, 4)],
    ids=["prefill", "one", "one-after-past", "several-after-past", "beam"],
)
def test_draft_graph_matches_the_head(tmp_path, write, batch, new, past):
    """Both draft graphs (the TorchScript export, the one on onnxruntime's fused attention)
    compute the torch head: the first run of a request (no past), drafts after a past, the
    pending positions of a verify (several new), a tree's beam (several rows)."""
    import onnxruntime as ort

    torch.manual_seed(0)  # head size 16: what onnxruntime's GroupQueryAttention takes
    head = EagleHead(
        dataclasses.replace(CFG, heads=2, kv_heads=1, head_dim=16),
        torch.randn(50, 32),
        torch.arange(0, 40, 2),
    ).eval()
    write(head, tmp_path / "d.onnx")
    sess = ort.InferenceSession(str(tmp_path / "d.onnx"), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(past + 10 * new + 100 * batch)
    feeds = {
        "input_ids": rng.integers(0, 50, (batch, new)).astype(np.int64),
        "features": rng.standard_normal((batch, new, 96)).astype(np.float32),
        "hidden_in": 0.1 * rng.standard_normal((batch, new, 32)).astype(np.float32),
        "past_key": rng.standard_normal((batch, 1, past, 16)).astype(np.float32),
        "past_value": rng.standard_normal((batch, 1, past, 16)).astype(np.float32),
    }
    with torch.no_grad():
        expect = head(*(torch.from_numpy(feeds[k]) for k in feeds))
    if "seqlens_k" in {i.name for i in sess.get_inputs()}:  # the fused graph's lengths
        feeds["seqlens_k"] = np.full(batch, past + new - 1, np.int32)
        feeds["total_sequence_length"] = np.array(past + new, np.int32)
    token, logits, hidden, key, value = sess.run(None, feeds)
    np.testing.assert_array_equal(token, expect[0].numpy())
    assert set(token.tolist()) <= set(range(0, 40, 2))  # target ids of the draft vocabulary
    np.testing.assert_allclose(logits, expect[1].numpy(), atol=2e-3)  # fp16 embedding table
    np.testing.assert_allclose(hidden, expect[2].numpy(), atol=2e-3)
    np.testing.assert_allclose(key, expect[3].numpy(), atol=2e-3)
    np.testing.assert_allclose(value, expect[4].numpy(), atol=2e-3)
    assert key.shape == value.shape == (batch, 1, past + new, 16)


def test_heads_the_fused_attention_cannot_take_get_the_exported_graph_in_int8(tmp_path):
    import onnx
    import onnxruntime as ort

    from specport.exporter.eagle_artifact import export_draft, write_cpu_draft
    from specport.exporter.eagle_graph import fusable, fused_draft_graph

    assert fusable(CFG) == "head size 8 is not a multiple of 16"
    with pytest.raises(ValueError, match="multiple of 16"):
        fused_draft_graph(tiny_eagle_head(), max_positions=32)
    head = tiny_eagle_head()
    export_draft(head, tmp_path / "d.onnx")
    assert write_cpu_draft(head, tmp_path / "d.onnx", tmp_path / "d8.onnx", 32) == "exported"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.onnx", "d8.onnx"]  # no leftovers
    ops = {n.op_type for n in onnx.load(str(tmp_path / "d8.onnx")).graph.node}
    assert "MatMulInteger" in ops and "GroupQueryAttention" not in ops
    sess = ort.InferenceSession(str(tmp_path / "d8.onnx"), providers=["CPUExecutionProvider"])
    empty = np.zeros((1, 2, 0, 8), np.float32)
    feeds = {"input_ids": np.array([[3, 7]]), "features": np.ones((1, 2, 96), np.float32)}
    feeds |= {"hidden_in": np.zeros((1, 2, 32), np.float32)}
    token = sess.run(["draft_token"], {**feeds, "past_key": empty, "past_value": empty})[0]
    assert int(token[0]) in range(0, 40, 2)
