"""Log-probabilities of a generated token and its top alternatives, for OpenAI's `logprobs`.

Taken from the model's raw logits at that position (a log-softmax before temperature, penalties,
logit bias or top-k/p), which is what vLLM returns by default and what lets a client compare
answers across sampling settings.
"""

from __future__ import annotations

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
