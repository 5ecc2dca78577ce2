"""Log-probabilities of a generated token and its top alternatives, for OpenAI's `logprobs`.

Taken from the model's raw logits at that position (a log-softmax before temperature, penalties,
logit bias or top-k/p), which is what vLLM returns by default and what lets a client compare
answers across sampling settings.

The batching engine has those logits at every step. The serial engine runs `Model.generate`,
whose decoders (plain, and every speculative one) keep no logits, so `score` re-reads them:
one run of the model over the prompt and the generated tokens. That is the target model's
log-softmax at every accepted token whatever proposed it (a draft, n-grams, MTP heads), as
vLLM reports under speculative decoding, for the price of one prefill.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from specport.runtime.engine.base import TokenLogprobs


def token_logprobs(logits: np.ndarray, token: int, k: int) -> TokenLogprobs:
    """`logits` [V] float -> the chosen token's logprob and the `k` best (id, logprob), best first."""
    x = np.asarray(logits, dtype=np.float64)
    top = x.max()
    logz = top + np.log(np.exp(x - top).sum())
    best: tuple[tuple[int, float], ...] = ()
    if k > 0:
        ids = np.argpartition(-x, k - 1)[:k] if k < x.size else np.arange(x.size)
        ids = ids[np.argsort(-x[ids], kind="stable")]
        best = tuple((int(i), float(x[i] - logz)) for i in ids)
    return TokenLogprobs(int(token), float(x[token] - logz), best)


def score(model: Any, prompt: Sequence[int], tokens: Sequence[int], k: int) -> list[TokenLogprobs]:
    """The logprobs of `tokens` generated after `prompt` by `model` (a `specport.api.Model`):
    one `TokenLogprobs` per token, from one run over prompt + tokens (an empty cache first)."""
    from specport.runtime.kv.seq_cache import open_cache

    if not tokens:
        return []
    ids = [int(t) for t in prompt] + [int(t) for t in tokens]
    cache = open_cache(model.session, model.manifest, len(ids))
    if len(prompt) > 1:  # the prompt's own logits are not needed: only its last is kept
        cache.step(ids[: len(prompt) - 1], last_only=True)
    logits = cache.step(ids[len(prompt) - 1 : -1]).logits  # [N, V]: the scores before each token
    return [token_logprobs(row, t, k) for row, t in zip(logits, ids[len(prompt) :])]
