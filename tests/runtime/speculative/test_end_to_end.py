"""Proposer + verifier on a real model (stories260K in PyTorch, no KV cache).

Greedy speculative decoding must reproduce plain greedy decoding token for token, whatever
the proposer drafts; the acceptance counters are reported for the record.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from specport.runtime.sampler import Sampler, SamplingConfig
from specport.runtime.speculative.base import Drafts
from specport.runtime.speculative.metrics import SpecDecodingStats
from specport.runtime.speculative.ngram import NgramProposer
from specport.runtime.speculative.verify import greedy_verify, rejection_verify

logger = logging.getLogger(__name__)

PROMPT = [1, 403, 407, 261, 378]  # "Once upon a time" with BOS
NEW_TOKENS = 96

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model(shared_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    path = shared_path("models", "stories260K")
    torch.set_num_threads(1)
    m = transformers.LlamaForCausalLM.from_pretrained(str(path)).eval()

    def logits(ids: list[int]) -> np.ndarray:  # [S, V]
        with torch.no_grad():
            return m(torch.tensor([ids])).logits[0].numpy()

    return logits


def _target_window(logits, ctx: list[int], drafts: Drafts) -> np.ndarray:  # [1, K+1, V]
    """Target scores after ctx and after each draft prefix."""
    out = logits(ctx + drafts.row(0))[len(ctx) - 1 :]
    pad = drafts.width + 1 - out.shape[0]  # rows shorter than K (batch padding)
    return np.pad(out, ((0, pad), (0, 0)))[None]


def test_greedy_speculative_equals_greedy(model):
    ctx = list(PROMPT)
    for _ in range(NEW_TOKENS):
        ctx.append(int(np.argmax(model(ctx)[-1])))
    reference = ctx[len(PROMPT) :]

    proposer, stats = NgramProposer(max_draft=4), SpecDecodingStats()
    ctx = list(PROMPT)
    while len(ctx) - len(PROMPT) < NEW_TOKENS:
        drafts = proposer.propose([ctx], 4)
        result = greedy_verify(drafts, _target_window(model, ctx, drafts))
        stats.observe(drafts, result)
        ctx += result.tokens[0]
    assert ctx[len(PROMPT) : len(PROMPT) + NEW_TOKENS] == reference
    assert stats.num_accepted_tokens > 0  # the n-gram drafts did save target steps
    logger.info("ngram on stories260K: %s", stats.as_dict())


def test_rejection_sampling_on_real_model_is_seeded(model):
    cfg = SamplingConfig(greedy=False, temperature=0.8, top_p=0.95)
    runs = []
    for _ in range(2):
        sampler, rng = Sampler(cfg, 512), np.random.default_rng(123)
        ctx, proposer = list(PROMPT), NgramProposer(max_draft=3)
        while len(ctx) - len(PROMPT) < 24:
            drafts = proposer.propose([ctx], 3)
            probs = sampler.probs(_target_window(model, ctx, drafts))
            ctx += rejection_verify(drafts, probs, rng).tokens[0]
        runs.append(ctx)
    assert runs[0] == runs[1]
    assert all(0 <= t < 512 for t in runs[0])
