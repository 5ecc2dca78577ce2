"""--tree-mask export: causal runs equal the plain artifact, tree nodes equal their chain runs."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from specport.core.contract import TREE_MASK, causal_tree_mask, prefill_feeds
from specport.core.errors import ExportError


def tree_artifact(zoo: Any, fuse: bool) -> Path:
    """A --tree-mask export of the zoo's tiny Llama, cached on the zoo for the session."""
    from tests.export_cache import cached_export

    cache = zoo.__dict__.setdefault("tree_artifacts", {})
    if fuse not in cache:
        out = zoo.root / "art" / f"llama-tree-{'fused' if fuse else 'plain'}"
        cached_export(  # the traced tree (shared: tests/exporter/test_tree_mask_shared.py)
            zoo.source("llama"), out, fuse=fuse, tree_mask=True, kv_layout="concat", progress=False
        )
        cache[fuse] = out
    return cache[fuse]


def _session(path: Path) -> Any:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    return ort.InferenceSession(str(path / "model.onnx"), so, providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def sessions(tiny_zoo: Any) -> dict[str, Any]:
    return {
        "plain": _session(tiny_zoo.artifact("llama", fuse=False)),
        "tree": _session(tree_artifact(tiny_zoo, fuse=False)),
        "tree_fused": _session(tree_artifact(tiny_zoo, fuse=True)),
    }


def _run(sess: Any, ids: list[int], past: list[np.ndarray], pos: np.ndarray, tree=None):
    """One batch-1 run: ids [S] at positions pos [S] on `past`; tree [S, S] or causal."""
    s, p = len(ids), past[0].shape[2]
    names = [i.name for i in sess.get_inputs() if i.name.startswith("past_key_values.")]
    feeds = {
        "input_ids": np.asarray([ids], np.int64),
        "attention_mask": np.ones((1, p + s), np.int64),
        "position_ids": np.asarray(pos, np.int64)[None],
        **dict(zip(names, past)),
    }
    if any(i.name == TREE_MASK for i in sess.get_inputs()):
        feeds[TREE_MASK] = causal_tree_mask(1, s) if tree is None else tree[None]
    out = sess.run(None, feeds)
    return out[0][0], out[1:]  # logits [S, V], presents


def _empty(sess: Any) -> list[np.ndarray]:
    return [
        np.zeros((1, i.shape[1], 0, i.shape[3]), np.float32)
        for i in sess.get_inputs()
        if i.name.startswith("past_key_values.")
    ]


def test_refuses_what_cannot_carry_a_tree(tmp_path):
    from tests.export_cache import cached_export

    with pytest.raises(ExportError, match="drop --no-fuse"):  # shared takes the tree fused
        cached_export(
            tmp_path / "none", tmp_path / "o", tree_mask=True, kv_layout="shared", fuse=False
        )
    with pytest.raises(ExportError, match="fuse_attention"):
        cached_export(
            tmp_path / "none",
            tmp_path / "o",
            tree_mask=True,
            kv_layout="concat",
            passes=["fuse_attention"],
        )


def test_tree_attention_mask_values():
    import torch

    from specport.exporter.wrapper import tree_attention_mask

    pad = torch.tensor([[0, 1, 1, 1, 1]])  # P = 3 (first slot padding), S = 2
    tree = torch.tensor([[[1, 0], [0, 1]]])  # two siblings
    m = tree_attention_mask(pad, tree, torch.float32)[0, 0]  # [S, P+S]
    allowed = (m == 0).int().tolist()
    assert allowed == [[0, 1, 1, 1, 0], [0, 1, 1, 0, 1]]
    assert torch.isfinite(m).all()


def test_tree_attention_mask_window():
    import torch

    from specport.exporter.wrapper import tree_attention_mask

    pad = torch.ones(1, 6, dtype=torch.int64)  # P = 3, S = 3: root, child, sibling
    tree = torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]])
    m = tree_attention_mask(pad, tree, torch.float32, window=3)[0, 0]
    # slots: root 3, child 4, sibling 4 -> keys must be > slot - 3
    assert (m == 0).int().tolist() == [[0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 0], [0, 0, 1, 1, 0, 1]]


def test_sliding_layout():
    from specport.exporter.wrapper import sliding_layout

    def cfg(**kw: Any) -> SimpleNamespace:
        return SimpleNamespace(**kw)

    assert sliding_layout(cfg()) == (None, False)
    assert sliding_layout(cfg(sliding_window=8)) == (8, False)  # Mistral: every layer
    assert sliding_layout(cfg(sliding_window=8, use_sliding_window=False)) == (None, False)
    full = ["full_attention"] * 2
    assert sliding_layout(cfg(sliding_window=8, layer_types=full)) == (None, False)
    mixed = ["sliding_attention", "full_attention"]
    assert sliding_layout(cfg(sliding_window=8, layer_types=mixed)) == (8, True)
    with pytest.raises(ValueError, match="chunked"):
        sliding_layout(cfg(layer_types=["chunked_attention"]))


@pytest.mark.slow
def test_sliding_window_model_verifies(tiny_zoo, tmp_path):
    """Tiny Mistral (window 8): export verification compares every causal case with the plain
    model and every tree node with a plain chain run, over sequences longer than the window."""
    from tests.export_cache import cached_export

    m = cached_export(
        tiny_zoo.source("mistral"), tmp_path / "m", fuse=False, tree_mask=True, progress=False
    )
    assert m.verify["ok"] and m.verify["cases"][-1]["name"] == "tree_b2_past"


@pytest.mark.slow
def test_manifest_records_tree_and_fusion(tiny_zoo):
    from specport.artifact.manifest import read_manifest

    for fuse in (False, True):
        m = read_manifest(tree_artifact(tiny_zoo, fuse))
        assert TREE_MASK in [i["name"] for i in m.io["inputs"]]
        assert m.extra["tree_mask"]["input"] == TREE_MASK
        assert m.verify["ok"] and "tree_b2_past" in [c["name"] for c in m.verify["cases"]]
        names = [p["name"] for p in m.passes]
        assert "fuse_attention" not in names
        if fuse:
            assert "fuse_rms_norm" in names and "fuse_rotary" in names


@pytest.mark.slow
def test_causal_tree_mask_equals_plain(sessions):
    plain = sessions["plain"]
    ids = [5, 9, 17, 5, 9, 33, 2]
    base_logits, base_kv = _run(plain, ids, _empty(plain), np.arange(7))
    step_logits, _ = _run(plain, [40, 41, 42], base_kv, np.arange(7, 10))
    for name in ("tree", "tree_fused"):
        sess = sessions[name]
        logits, kv = _run(sess, ids, _empty(sess), np.arange(7))
        np.testing.assert_allclose(logits, base_logits, atol=1e-5)
        for a, b in zip(kv, base_kv):
            np.testing.assert_allclose(a, b, atol=1e-5)
        logits, _ = _run(sess, [40, 41, 42], kv, np.arange(7, 10))
        np.testing.assert_allclose(logits, step_logits, atol=1e-5)
        full = sess.run(["logits"], prefill_feeds(sess, np.asarray(ids, np.int64)))[0][0]
        np.testing.assert_allclose(full, base_logits, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tree", "tree_fused"])
def test_branching_tree_nodes_equal_chain_runs(sessions, name):
    """The core property: each node's logits (and K/V) are those of a chain run of its path."""
    from specport.runtime.speculative.token_tree import TokenTree

    plain, sess = sessions["plain"], sessions[name]
    rng = np.random.default_rng(1)
    prompt = rng.integers(3, 256, size=6).tolist()
    _, past = _run(plain, prompt, _empty(plain), np.arange(6))
    tree = TokenTree(root=7, max_nodes=32)
    for path in ([11, 12, 13], [11, 14], [15, 16, 17, 18], [15, 16, 19], [20]):
        tree.add(path)
    tokens, depths, anc = tree.flatten()
    assert len(tree) == 11 and tree.max_depth == 4
    logits, presents = _run(sess, tokens.tolist(), past, 6 + depths, anc)
    for node in range(len(tree)):
        path = tree.path_to(node)
        chain = [int(tokens[i]) for i in path]
        ref, ref_kv = _run(plain, chain, past, np.arange(6, 6 + len(chain)))
        np.testing.assert_allclose(logits[node], ref[-1], atol=1e-5, err_msg=str(chain))
        for got, want in zip(presents, ref_kv):
            np.testing.assert_allclose(got[:, :, 6 + node], want[:, :, -1], atol=1e-5)
    # a branching tree really differs from feeding the same tokens causally
    causal, _ = _run(sess, tokens.tolist(), past, 6 + depths)
    assert np.abs(causal - logits).max() > 1e-3


@pytest.mark.slow
def test_plain_generation_on_tree_artifact(tiny_zoo):
    import specport

    plain = specport.load(tiny_zoo.artifact("llama", fuse=False))
    tree = specport.load(tree_artifact(tiny_zoo, fuse=True))
    for ids in ([5, 6, 7, 5, 6], [9] * 10, [3]):
        want = plain.generate(prompt_ids=ids, max_new_tokens=12, ignore_eos=True).tokens
        assert tree.generate(prompt_ids=ids, max_new_tokens=12, ignore_eos=True).tokens == want
    rows = [[5, 6, 7], [8]]  # left padding goes through attention_mask + a causal tree_mask
    batch = tree.generate_batch(prompt_ids=rows, max_new_tokens=6, ignore_eos=True)
    ref = plain.generate_batch(prompt_ids=rows, max_new_tokens=6, ignore_eos=True)
    assert [r.tokens for r in batch] == [r.tokens for r in ref]


@pytest.mark.slow
def test_other_feed_builders_on_tree_artifact(tiny_zoo):
    """Batched speculative decoding and chunked evaluation feed a causal tree_mask too."""
    import specport
    from specport.runtime.eval import _logits

    plain_path, tree_path = tiny_zoo.artifact("llama", fuse=False), tree_artifact(tiny_zoo, True)
    rows = [[5, 6, 7, 5, 6, 7, 5], [8, 9]]
    kw = dict(prompt_ids=rows, max_new_tokens=10, speculative="ngram", num_draft=3)
    want = [r.tokens for r in specport.load(plain_path).generate_batch(**kw)]
    assert [r.tokens for r in specport.load(tree_path).generate_batch(**kw)] == want
    ids = np.random.default_rng(0).integers(3, 256, size=40)
    # manifest None: the concat feeds (a shared artifact is scored through its own cache)
    plain = SimpleNamespace(sess=_session(plain_path), manifest=None)
    tree = SimpleNamespace(sess=_session(tree_path), manifest=None)
    ref = _logits(plain, ids)  # type: ignore[arg-type]
    got = _logits(tree, ids, chunk=16)  # type: ignore[arg-type]
    np.testing.assert_allclose(got, ref, atol=1e-5)
