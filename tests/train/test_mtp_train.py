"""Training MTP heads: self-distillation learns, answers are computed in their own prompt's
context, windowed training, the default draft vocabulary, and `train_mtp` on a DeepSeek-V3
artifact using its checkpoint's MTP layer (greedy output unchanged)."""

from __future__ import annotations

import pytest
import torch

from specport.exporter.mtp_heads import MTPHeads
from specport.exporter.mtp_weights import load_heads, save_heads
from specport.train.mtp_objective import acceptance, chain_loss
from specport.train.mtp_train import train_heads
from tests.fixtures import frozen_tiny_llama


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return frozen_tiny_llama(tmp_path_factory.mktemp("mtp_train") / "src")


def _greedy_sequences(base, n: int = 24, prompt: int = 4, new: int = 28) -> torch.Tensor:
    from specport.train.mtp_data import self_generate

    g = torch.Generator().manual_seed(0)
    return self_generate(base, torch.randint(3, 256, (n, prompt), generator=g), new)


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


def test_windowed_training_runs_and_reports(llama):
    seqs = _greedy_sequences(llama, n=16, new=20)
    heads, report = train_heads(llama, seqs, num_heads=2, steps=3, batch=4, window=8)
    assert report["window"] == 8 and report["steps"] == 3
    assert 1.0 <= report["heldout"]["mean_accepted_length"] <= 3.0


def test_default_draft_vocabulary_only_on_large_vocabularies():
    from specport.train.mtp_train import auto_draft_vocab

    assert auto_draft_vocab(256) == 0 and auto_draft_vocab(16384) == 0
    assert auto_draft_vocab(49152) == 8192 and auto_draft_vocab(151936) == 8192
