"""--kv-layout shared --tree-mask: the tree reaches the fused attention as its bias.

Plain (causal) runs equal the plain shared artifact; every node of a branching tree scored in
one run on top of an in-place past equals a chain run of its root-to-leaf path.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import specport
from specport.core.contract import TREE_MASK
from specport.core.errors import ExportError
from specport.runtime.kv.seq_cache import open_cache
from specport.runtime.speculative.token_tree import TokenTree

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def models(tiny_zoo: Any) -> tuple[Any, Any]:
    plain = specport.load(tiny_zoo.shared("llama"), provider="cpu", threads=1)
    tree = specport.load(tiny_zoo.shared("llama", tree_mask=True), provider="cpu", threads=1)
    return plain, tree


def test_manifest_and_verification(models):
    _, tree = models
    m = tree.manifest
    assert m.kv.layout == "shared"
    inputs = {i.name for i in tree.session.get_inputs()}
    assert {TREE_MASK, "position_ids", "seqlens_k"} <= inputs
    assert "attention_mask" not in inputs
    assert m.extra[TREE_MASK]["input"] == TREE_MASK
    assert m.extra["runtime"]["position_ids"] is True
    cases = {c["name"]: c for c in m.verify["cases"]}
    assert m.verify["ok"] and cases["tree_b2_past"]["ok"]  # checked against PyTorch chains
    report = next(p for p in m.passes if p["name"] == "tree_bias")
    assert report["modified"] and report["layers"] == m.config["num_layers"]
    ops = report["ops_after"]
    assert ops["com.microsoft.GroupQueryAttention"] == m.config["num_layers"]


def test_causal_runs_equal_the_plain_shared_artifact(models):
    plain, tree = models
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 200, size=12).tolist()
    a, b = (
        open_cache(plain.session, plain.manifest, 32),
        open_cache(tree.session, tree.manifest, 32),
    )
    for chunk in (ids[:7], ids[7:8], ids[8:12]):  # prefill, a decode step, a chunk on a past
        np.testing.assert_allclose(a.step(chunk).logits, b.step(chunk).logits, atol=1e-5)
    for x, y in zip(a.bound.kv.buffers, b.bound.kv.buffers):
        np.testing.assert_allclose(x[:, :, :12], y[:, :, :12], atol=1e-5)


def test_tree_nodes_equal_their_root_to_leaf_chains(models):
    _, tree_model = models
    rng = np.random.default_rng(1)
    context = rng.integers(3, 200, size=9).tolist()
    tree = TokenTree(context[-1], 16)
    for path in ([5, 6, 7], [5, 8], [9, 10, 11, 12], [9, 13], [14]):
        tree.add(path)
    tokens, depths, anc = tree.flatten()
    cache = open_cache(tree_model.session, tree_model.manifest, 40)
    cache.step(context[:-1], last_only=True)
    step = cache.step(tokens.tolist(), tree=(depths, anc))
    assert step.logits.shape == (len(tree), tree_model.manifest.vocab_size)
    leaves = [n for n in range(len(tree)) if not tree.children[n]]
    assert len(leaves) == 5
    for leaf in leaves:
        path = tree.path_to(leaf)
        chain = open_cache(tree_model.session, tree_model.manifest, 40)
        want = chain.step([*context, *(tree.tokens[i] for i in path[1:])]).logits
        got = step.logits[path]  # node logits along the path = the chain's last len(path) rows
        np.testing.assert_allclose(got, want[-len(path) :], atol=1e-4)
    # the tree really is a tree: a causal run over the same tokens scores differently
    causal = open_cache(tree_model.session, tree_model.manifest, 40)
    causal.step(context[:-1], last_only=True)
    assert np.abs(causal.step(tokens.tolist()).logits - step.logits).max() > 1e-2


def test_auto_picks_shared_and_sliding_windows_keep_the_concat_tree(tiny_zoo, tmp_path):
    from tests.export_cache import cached_export

    m = cached_export(
        tiny_zoo.source("llama"), tmp_path / "a", tree_mask=True, skip_verify=True, progress=False
    )
    assert m.kv.layout == "shared" and m.extra["kv_layout_choice"]["requested"] == "auto"
    mistral = tiny_zoo.source("mistral")
    with pytest.raises(ExportError, match="sliding window"):
        specport.export(mistral, tmp_path / "o", kv_layout="shared", tree_mask=True, progress=False)
    assert not (tmp_path / "o").exists()
    m = cached_export(mistral, tmp_path / "m", tree_mask=True, skip_verify=True, progress=False)
    assert m.kv.layout == "concat" and "sliding" in m.extra["kv_layout_choice"]["reason"]
    assert TREE_MASK in {i["name"] for i in m.io["inputs"]}


def test_model_card_snippet_runs_in_a_bare_session(models, monkeypatch):
    from specport.artifact.model_card import _bare_session

    _, tree = models
    code = "\n".join(_bare_session(tree.manifest))
    assert '"tree_mask"' in code and '"position_ids"' in code
    monkeypatch.chdir(tree.path)
    scope: dict[str, Any] = {}
    exec(code, scope)  # the README's plain-onnxruntime recipe, as a user would paste it
    assert scope["logits"].shape == (1, 1, tree.manifest.vocab_size)


def test_a_tree_that_cannot_reach_the_attention_is_an_error(tiny_zoo, tmp_path, monkeypatch):
    """Should the bias slot ever be taken (tree_bias refuses), the export says so, in one line."""
    from specport.exporter.export import export_model
    from specport.passes.tree_bias import TreeBiasPass

    monkeypatch.setattr(TreeBiasPass, "precondition", lambda self, model: "bias slot taken")
    with pytest.raises(ExportError, match="bias slot taken.*--kv-layout concat"):
        export_model(
            tiny_zoo.source("llama"),
            tmp_path / "o",
            kv_layout="shared",
            tree_mask=True,
            skip_verify=True,
            progress=False,
        )
    assert not (tmp_path / "o").exists()
