"""MTP heads: shapes, self-distillation learns, DeepSeek-V3 checkpoint MTP layers load."""

from __future__ import annotations

import pytest
import torch

from specport.errors import InputError
from specport.exporter.mtp_heads import MTPBranch, MTPHeads
from specport.exporter.mtp_weights import load_deepseek_mtp, load_heads, save_heads
from specport.train.mtp_objective import acceptance, chain_loss
from specport.train.mtp_train import train_heads


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from tests.fixtures import build_tiny_model, load_reference

    src = build_tiny_model("llama", tmp_path_factory.mktemp("mtp_heads") / "src")
    model = load_reference(src, "llama")
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def _greedy_sequences(base, n: int = 24, prompt: int = 4, new: int = 28) -> torch.Tensor:
    from specport.train.mtp_data import self_generate

    g = torch.Generator().manual_seed(0)
    return self_generate(base, torch.randint(3, 256, (n, prompt), generator=g), new)


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


@pytest.mark.slow
def test_self_distillation_improves_acceptance(llama, tmp_path):
    seqs = _greedy_sequences(llama)
    from specport.train.mtp_data import base_hidden

    hidden = base_hidden(llama, seqs)
    untrained = MTPHeads(llama, 2).eval()
    before = acceptance(untrained, hidden, seqs)["mean_accepted_length"]
    with torch.no_grad():
        loss0 = float(chain_loss(untrained, llama, hidden, seqs))
    heads, report = train_heads(llama, seqs, 2, steps=60, batch=8, progress=False)
    with torch.no_grad():
        loss1 = float(chain_loss(heads, llama, hidden, seqs))
    assert loss1 < loss0
    assert report["heldout"]["mean_accepted_length"] >= 1.0
    assert acceptance(heads, hidden, seqs)["mean_accepted_length"] > before
    path = save_heads(heads, tmp_path)
    again = load_heads(llama, path)
    h = torch.randn(1, 3, 64)
    t = torch.randint(0, 256, (1, 3))
    torch.testing.assert_close(again.step(1, h, t)[1], heads.step(1, h, t)[1])


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


@pytest.mark.slow
def test_deepseek_artifact_runs_checkpoint_mtp_branch(tmp_path):
    """train-mtp on a DeepSeek-V3 artifact uses the real MTP layer; greedy output is unchanged."""
    import numpy as np

    import specport
    from specport.runtime.sampler import SamplingConfig
    from specport.runtime.speculative.loop import generate_speculative
    from specport.train.mtp_train import train_mtp
    from tests.export_cache import cached_export
    from tests.fixtures import build_tiny_model

    src = build_tiny_model("deepseek_v3", tmp_path / "src")
    cached_export(src, tmp_path / "art", fuse=False, skip_verify=True, progress=False)
    manifest = train_mtp(tmp_path / "art", tmp_path / "mtp", num_heads=3)
    assert manifest.mtp["heads"] == 1 and manifest.mtp["training"]["source"] == "checkpoint"
    base, mtp = specport.load(tmp_path / "art"), specport.load(tmp_path / "mtp")
    rng = np.random.default_rng(0)
    for _ in range(3):
        ids = rng.integers(3, 256, size=5).tolist()
        plain = base.generate(prompt_ids=ids, max_new_tokens=12, ignore_eos=True).tokens
        toks, _, _ = generate_speculative(mtp, ids, 12, "mtp", 1, None, SamplingConfig(), (), None)
        assert toks == plain


def test_chat_answers_are_computed_in_their_own_prompts_context(llama):
    """Prompts and answers of different lengths share a padded batch; every row's tokens and
    LM-head inputs equal those of the same prompt + answer run alone (padding masked,
    positions from the prompt's start), and only the answer's own tokens count as valid."""
    from specport.train.mtp_data import answer_hidden, base_hidden, self_generate

    prompts = [[5, 17, 42, 9, 11, 3], [7, 8], [100, 101, 102, 4]]
    alone = [self_generate(llama, torch.tensor([p]), 6)[0] for p in prompts]
    answers = [
        a[len(p) : len(p) + 6 - 2 * r].tolist() for r, (a, p) in enumerate(zip(alone, prompts))
    ]
    seqs, hidden, valid = answer_hidden(llama, prompts, answers, new_tokens=6)
    assert seqs.shape == (3, 7) and hidden.shape[:2] == (3, 7) and valid.shape == (3, 7)
    for row, (p, a) in enumerate(zip(prompts, answers)):
        n = 1 + len(a)
        assert valid[row].tolist() == [True] * n + [False] * (7 - n)
        assert seqs[row, :n].tolist() == alone[row][len(p) - 1 : len(p) + len(a)].tolist()
        want = base_hidden(llama, alone[row][None])[0, len(p) - 1 : len(p) + len(a)]
        assert torch.allclose(hidden[row, :n], want, atol=1e-4), (
            (hidden[row, :n] - want).abs().max()
        )


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


def test_windowed_training_runs_and_reports(llama):
    seqs = _greedy_sequences(llama, n=16, new=20)
    heads, report = train_heads(llama, seqs, num_heads=2, steps=3, batch=4, window=8)
    assert report["window"] == 8 and report["steps"] == 3
    assert 1.0 <= report["heldout"]["mean_accepted_length"] <= 3.0


def test_default_draft_vocabulary_only_on_large_vocabularies():
    from specport.train.mtp_train import auto_draft_vocab

    assert auto_draft_vocab(256) == 0 and auto_draft_vocab(16384) == 0
    assert auto_draft_vocab(49152) == 8192 and auto_draft_vocab(151936) == 8192
