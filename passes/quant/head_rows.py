"""How much a tied LM head loses when its first rows are 8-bit and the rest narrower.

The budget planner (budget.py) chooses where the tied head and table split (vocab_split.py):
how many of the first ids to keep at 8 bits. A row's logit error costs loss in proportion to
how often its token is predicted: the KL between the float and the quantized next-token
distributions is, to second order, the variance under p of the logit errors, sum_i p_i dz_i^2.
So each row's output error (dW_i^T H dW_i, H the head input's Gram matrix) is weighted by its
token's frequency, and the table's row error likewise (a row is gathered as often as its token
appears). With every weight equal this is the planner's unweighted relative error.

Frequencies come from the calibration text's tokens when there is one, smoothed by a prior
with one pseudo-count per id, since a few thousand documents leave most of a 50k vocabulary
unseen. The prior is Zipf's law over ids, p_i ~ 1/(i + ZIPF_OFFSET): byte-level BPE numbers
tokens in merge order, roughly by frequency in the tokenizer's training text. Measured on
SmolLM2-135M's tokenizer, the share of tokens below id 1,024 / 4,096 / 16,384 is 0.49 / 0.74 /
0.90 on WikiText-2 test, 0.61 / 0.77 / 0.91 on the mixed calibration text, 0.55 / 0.77 / 0.94
on TinyStories; the prior gives 0.52 / 0.69 / 0.86. Where ids are not ordered by frequency the
weighted errors show it and the planner keeps the head whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specport.passes.quant.blockquant import dequantize
from specport.passes.quant.rtn import quantize_rtn

ZIPF_OFFSET = 16
# Candidate split points, as shares of the vocabulary (SmolLM2's 49,152: 1,024 ... 24,576).
SPLIT_SHARES = (1 / 48, 1 / 32, 1 / 24, 1 / 16, 1 / 12, 1 / 8, 1 / 6, 1 / 4, 1 / 3, 1 / 2)
COLUMNS = 8192  # output columns (head rows) measured at a time (bounded memory)


def token_frequencies(vocab: int, ids: np.ndarray | None = None) -> np.ndarray:
    """Expected share of each token id, summing to 1: the calibration tokens' counts with one
    pseudo-count per id spread by the Zipf prior, or the prior alone."""
    prior = 1.0 / (np.arange(vocab, dtype=np.float64) + ZIPF_OFFSET)
    prior /= prior.sum()
    if ids is None or ids.size == 0:
        return prior
    counts = np.bincount(ids[(ids >= 0) & (ids < vocab)].astype(np.int64), minlength=vocab)
    return (counts + vocab * prior) / (counts.sum() + vocab)


def split_points(vocab: int) -> list[int]:
    """Candidate frequent-row counts: shares of the vocabulary, multiples of 64 where large."""
    points = set()
    for share in SPLIT_SHARES:
        share_rows = vocab * share
        n = round(share_rows / 64) * 64 if share_rows >= 64 else round(share_rows)
        if 0 < n < vocab:
            points.add(n)
    return sorted(points)


def row_errors(
    w: np.ndarray, h: np.ndarray | None, hats: list[np.ndarray]
) -> tuple[list[np.ndarray], np.ndarray]:
    """Per column of w [K, N]: dW^T H dW for each w_hat of `hats`, and W^T H W (weight space
    without H); the planner's relative error of a whole weight is their sums' ratio."""
    h32 = None if h is None else h.astype(np.float32)
    nums = [np.empty(w.shape[1]) for _ in hats]
    den = np.empty(w.shape[1])
    for a in range(0, w.shape[1], COLUMNS):
        wc = w[:, a : a + COLUMNS]
        cols = slice(a, a + wc.shape[1])
        hw = wc if h32 is None else h32 @ wc
        den[cols] = np.einsum("kn,kn->n", wc, hw, dtype=np.float64)
        for num, hat in zip(nums, hats):
            dw = hat[:, cols] - wc
            hd = dw if h32 is None else h32 @ dw
            num[cols] = np.einsum("kn,kn->n", dw, hd, dtype=np.float64)
    return nums, den


@dataclass
class HeadRowErrors:
    """Frequency-weighted prefix sums of a tied head's per-row errors at each (bits, block):
    `error(n, wide, narrow)` is the relative error with rows < n at `wide`, the rest `narrow`."""

    head: dict[tuple[int, int], np.ndarray]  # cumulative weighted head error numerators
    table: dict[tuple[int, int], np.ndarray]  # the same for the gathered table (weight space)
    head_den: float
    table_den: float

    def error(
        self, n: int, wide: tuple[int, int], narrow: tuple[int, int], head_weight: float
    ) -> float:
        def part(cum: dict[tuple[int, int], np.ndarray], den: float) -> float:
            lo = cum[wide][n - 1] if n > 0 else 0.0
            hi = cum[narrow][-1] - (cum[narrow][n - 1] if n > 0 else 0.0)
            return float((lo + hi) / max(den, 1e-30))

        return head_weight * part(self.head, self.head_den) + part(self.table, self.table_den)


def measure_head_rows(
    w: np.ndarray,
    h: np.ndarray | None,
    freq: np.ndarray,
    combos: list[tuple[int, int]],
    symmetric: bool,
) -> HeadRowErrors:
    """Per-row errors of the tied head w [K, V] (its table is w^T) at every (bits, block) of
    `combos`, weighted by `freq` [V]. The table is quantized asymmetrically (GatherBlockQuantized
    with zero points); with a symmetric head its codes are measured separately."""
    head: dict[tuple[int, int], np.ndarray] = {}
    table: dict[tuple[int, int], np.ndarray] = {}
    head_den = table_den = 0.0
    for bits, group in combos:
        hat = dequantize(quantize_rtn(w, bits, group, symmetric))
        (num,), den = row_errors(w, h, [hat])
        head[(bits, group)] = np.cumsum(freq * num)
        head_den = float(freq @ den)
        if symmetric:
            hat = dequantize(quantize_rtn(w, bits, group, symmetric=False))
        (num,), den = row_errors(w, None, [hat])
        table[(bits, group)] = np.cumsum(freq * num)
        table_den = float(freq @ den)
        del hat
    return HeadRowErrors(head, table, head_den, table_den)
