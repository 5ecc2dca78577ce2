"""MTP heads as the exporter writes them: shapes, the folded form, a draft vocabulary, and
DeepSeek-V3 checkpoint MTP layers loading. Training them is tests/train/test_mtp_train.py."""

from __future__ import annotations

import pytest
import torch

from specport.core.errors import InputError
from specport.exporter.mtp_heads import MTPBranch, MTPHeads
from specport.exporter.mtp_weights import load_deepseek_mtp, load_heads, save_heads
from specport.train.mtp_objective import chain_loss
from tests.fixtures import frozen_tiny_llama


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return frozen_tiny_llama(tmp_path_factory.mktemp("mtp_heads") / "src")


def test_heads_shapes_and_branch(llama):
    heads = MTPHeads(llama, 3).eval()
    assert heads.num_heads == 3
    assert all(not k.startswith("_shared") for k in heads.state_dict())
    h = torch.randn(2, 5, 64)
    out, logits = heads.step(0, h, torch.randint(0, 256, (2, 5)))
    assert out.shape == (2, 5, 64) and logits.shape == (2, 5, 256)
    ids = torch.randint(0, 256, (2, 4))
    with torch.no_grad():
        hidden = llama.model(input_ids=ids).last_hidden_state
        acc, bonus, drafts = MTPBranch(heads)(hidden, llama.lm_head(hidden), ids)
    assert acc.shape == (2,) and bonus.shape == (2,) and drafts.shape == (2, 3)
    assert torch.all((acc >= 0) & (acc <= 3))
    with pytest.raises(InputError, match="heads"):
        MTPHeads(llama, 0)


def test_folded_heads_compute_the_same_function(llama):
    from specport.exporter.mtp_fold import fold_heads

    torch.manual_seed(1)
    heads = MTPHeads(llama, 2).eval()
    for p in heads.parameters():  # move away from the warm start so every piece matters
        p.data.add_(0.05 * torch.randn_like(p))
    folded = fold_heads(heads)
    assert folded is not None
    h = torch.randn(3, 1, 64)
    t = torch.randint(0, 256, (3, 1))
    with torch.no_grad():
        for k in range(2):
            want_h, want_logits = heads.step(k, h, t)
            got_h, normed = folded[k](h, t)
            torch.testing.assert_close(got_h, want_h, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(llama.lm_head(normed), want_logits, atol=1e-4, rtol=1e-4)


def test_deepseek_checkpoint_mtp_layers_load(tmp_path):
    from specport.exporter.archs.deepseek import DeepseekV3
    from tests.fixtures import build_tiny_model, load_reference

    src = build_tiny_model("deepseek_v3", tmp_path / "ds")
    base = load_reference(src, "deepseek_v3")
    weights = DeepseekV3.extra_weights(src, base.config)
    assert weights, "fixture should carry MTP weights"
    heads = load_deepseek_mtp(base, weights)
    assert heads.num_heads == 1
    prefix = f"model.layers.{base.config.num_hidden_layers}."
    torch.testing.assert_close(heads.heads[0].eh_proj.weight, weights[prefix + "eh_proj.weight"])
    block_keys = [k for k in weights if k.startswith(prefix) and ".mlp." in k]
    assert block_keys  # the decoder block's own weights came from the checkpoint
    ids = torch.randint(0, 256, (1, 3))
    with torch.no_grad():
        hidden = base.model(input_ids=ids).last_hidden_state
        _, _, drafts = MTPBranch(heads)(hidden, base.lm_head(hidden), ids)
    assert drafts.shape == (1, 1)
    bad = {
        k.replace(prefix, f"model.layers.{base.config.num_hidden_layers + 1}."): v
        for k, v in weights.items()
    }
    with pytest.raises(InputError, match="contiguous"):
        load_deepseek_mtp(base, bad)


def test_draft_vocabulary_scores_the_frequent_tokens_only(llama, tmp_path):
    """Heads with a draft vocabulary score its rows of the LM head exactly, map indices back to
    token ids, ignore targets outside it, and round-trip through save/load."""
    from specport.train.mtp_objective import coverage, frequent_tokens

    seqs = torch.tensor([[5, 5, 5, 9, 9, 200], [9, 5, 7, 7, 7, 7]])
    valid = torch.ones_like(seqs, dtype=torch.bool)
    valid[1, 2:] = False  # the 7s are padding
    ids = frequent_tokens(seqs, valid, 2, 256)
    assert ids.tolist() == [5, 9]
    heads = MTPHeads(llama, 2, draft_vocab=ids).eval()
    assert heads.draft_size == 2 and "draft_vocab" in heads.state_dict()
    assert all(not p.requires_grad or p.shape[0] != 2 for p in heads.parameters())
    h = torch.randn(1, 3, 64)
    with torch.no_grad():
        _, logits = heads.step(0, h, torch.tensor([[5, 9, 5]]))
        full = MTPHeads(llama, 2)
        full.load_state_dict({k: v for k, v in heads.state_dict().items() if k != "draft_vocab"})
        _, want = full.step(0, h, torch.tensor([[5, 9, 5]]))
    torch.testing.assert_close(logits, want[..., ids])
    assert heads.to_vocab(torch.tensor([1, 0])).tolist() == [9, 5]
    assert heads.draft_index(torch.tensor([9, 7, 5])).tolist() == [1, -100, 0]
    assert coverage(heads, seqs, valid) == round(7 / 8, 4)
    with torch.no_grad():
        loss = chain_loss(heads, llama, llama.model(input_ids=seqs).last_hidden_state, seqs, valid)
    assert torch.isfinite(loss)
    save_heads(heads, tmp_path)
    again = load_heads(llama, tmp_path / "mtp_heads.safetensors")
    assert again.draft_vocab.tolist() == [5, 9]
