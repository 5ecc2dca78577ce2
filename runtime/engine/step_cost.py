"""What a batched step costs, measured once per engine, and the verify width that pays most.

Rows verifying together feed a dense [b, w] block of ids (b = rows up to the highest decoding
one, w = 1 + the widest row's drafts): every row pays for w tokens in every MatMul, drafts or
not. On a CPU the run is compute-bound from a handful of tokens on, so its cost grows with the
token count b x w. Measured on SmolLM2-135M (fp32, 2 threads, 2-core machine, load ~4): a
batch-1 step 33 ms, 4 tokens 47-53 ms, 8 tokens 64-72 ms, 16 tokens 96-109 ms, 64 tokens
316-333 ms, close to a line `base + per_token x (tokens - 1)`. `StepCost.calibrate` measures
that line on the engine's own buffers when it starts (three short runs on its free rows), and
`best_width` compares, for each width, the tokens the rows are expected to emit against what
the run costs, plain decoding (width 1) included: a row without drafts, or whose drafts are
rarely accepted, no longer drags the whole step to the widest row's width.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specport.runtime.kv.cache import KVCache

logger = logging.getLogger(__name__)

__all__ = ["StepCost", "best_width"]

CALIBRATION_TOKENS = (1, 8, 16)  # tokens per calibration run (the first is a plain step)
CALIBRATION_REPEATS = 5  # rounds over every size; each size's fastest run counts


@dataclass
class StepCost:
    """Seconds of one run over `tokens` new tokens in all: base + per_token x (tokens - 1),
    times a scale per kind of run (plain, verify) that the engine's own timed steps correct
    (`observe`): a start-up measurement on a shared machine can be off, the steps it decodes
    are what they are."""

    base: float
    per_token: float
    plain_scale: float = 1.0
    verify_scale: float = 1.0

    def __call__(self, tokens: int) -> float:
        return self.base + self.per_token * max(0, int(tokens) - 1)

    def plain(self, tokens: int) -> float:
        return self.plain_scale * self(tokens)

    def verify(self, tokens: int) -> float:
        return self.verify_scale * self(tokens)

    def observe(self, tokens: int, seconds: float, verify: bool, decay: float = 0.9) -> None:
        """A timed run of `tokens` tokens. Plain steps also pull the verify scale a little
        toward theirs, so a verify cost once measured high is tried again later."""
        ratio = min(max(seconds / self(tokens), 0.25), 4.0)  # a stall is not a trend
        if verify:
            self.verify_scale = decay * self.verify_scale + (1.0 - decay) * ratio
        else:
            self.plain_scale = decay * self.plain_scale + (1.0 - decay) * ratio
            self.verify_scale += 0.02 * (self.plain_scale - self.verify_scale)

    @classmethod
    def fit(cls, samples: Sequence[tuple[int, float]]) -> StepCost:
        """Least squares over (tokens, seconds); the slope is never negative."""
        t = np.asarray([s[0] for s in samples], dtype=np.float64) - 1.0
        y = np.asarray([s[1] for s in samples], dtype=np.float64)
        if len(samples) < 2 or float(np.ptp(t)) == 0.0:
            return cls(float(y.mean()), 0.0)
        slope, intercept = (float(v) for v in np.polyfit(t, y, 1))
        if slope < 0.0:  # noise on a machine where more tokens cost nothing more
            return cls(float(y.mean()), 0.0)
        return cls(max(intercept, 1e-6), slope)

    @classmethod
    def calibrate(cls, slots: KVCache, rows: int) -> StepCost:
        """Time a plain batch-1 step and two batched verify runs on free rows [0, rows)
        (their lengths are put back: nothing they cache is kept). Call before any request."""
        start = slots.lengths.copy()
        sizes = [
            (1, 1) if n == 1 else (min(rows, 4), n // min(rows, 4)) for n in CALIBRATION_TOKENS
        ]
        times: dict[tuple[int, int], list[float]] = {size: [] for size in sizes}
        try:
            for repeat in range(CALIBRATION_REPEATS + 1):  # the first round warms up
                for batch, width in sizes:  # interleaved: a load spike hits every size alike
                    slots.lengths[:] = start
                    t0 = time.perf_counter()
                    ids = np.zeros((batch, width), dtype=np.int64)
                    slots.step(ids, np.ones(batch, dtype=bool))
                    if repeat:
                        times[(batch, width)].append(time.perf_counter() - t0)
        finally:
            slots.lengths[:] = start
        # the fastest run of each size: other processes only ever add time (a shared machine)
        samples = [(b * w, min(times[(b, w)])) for b, w in sizes]
        cost = cls.fit(samples)
        logger.info(
            "batched step cost: %.1f ms + %.2f ms per extra token (measured %s)",
            1e3 * cost.base,
            1e3 * cost.per_token,
            ", ".join(f"{n} tokens {1e3 * s:.1f} ms" for n, s in samples),
        )
        return cost


def best_width(
    cost: StepCost,
    batch: int,  # rows the run spans (up to the highest decoding row)
    drafts: Sequence[int],  # drafts each decoding row proposed (0: none)
    expected: Sequence[Sequence[float]],  # per row: expected tokens emitted with 0..d drafts
    max_tokens: int | None = None,  # hard cap on batch x width
) -> int:
    """The run width (1 + drafts per row) with the most expected tokens per second; 1 means
    a plain batched step pays best. `expected[r][k]` is row r's expected tokens when it
    verifies k drafts (`expected[r][0]` = 1)."""
    plain = len(drafts) / cost.plain(batch)
    best_w, best = 1, plain
    for w in range(2, 2 + max(drafts, default=0)):
        if max_tokens is not None and batch * w > max_tokens:
            break
        tokens = sum(e[min(d, w - 1)] for d, e in zip(drafts, expected))
        value = tokens / cost.verify(batch * w)
        if value > best:
            best_w, best = w, value
    return best_w
