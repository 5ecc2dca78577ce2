"""The batching engine's speculative step: rows draft and verify before the batched step.

`SpeculativeRows` is a mixin of `BatchingEngine` (kept apart so the engine module stays about
scheduling and `speculation.py` about the per-request state and the compute-bound rule). Two
ways to verify. Row by row (`_speculate`, via `EngineSpeculation.step`): a row verifies at batch
1 on its own contiguous view of the shared buffer (`KVSlots.verify`: the kernel writes in
place); rows that draft nothing this step (k = 0, no n-gram match, a sampler with presence /
frequency penalties, logit bias or a grammar) decode in the ordinary batched step. Together
(`_speculate_together`): every decoding row feeds [last, drafts] padded to the step's widest
row in one batched run (`KVSlots.verify_rows`), rows without drafts score their one token in
that run. onnxruntime's CPU GroupQueryAttention takes several new tokens on a past at batch > 1
only when it is given `query_seqlens` (without it: "batch_size must be 1 when sequence_length >
1 and past context is given"); shared-layout graphs feed it, and the engine checks the graph
once (`takes_batched_steps`) so that older artifacts keep verifying row by row. MTP stays row by
row: its drafts come out of the row's own run.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from specport.runtime.engine.base import TokenLogprobs
from specport.runtime.engine.logprobs import token_logprobs
from specport.runtime.engine.slots import KVSlots
from specport.runtime.speculative.base import Drafts

if TYPE_CHECKING:
    from specport.runtime.engine.speculation import EngineSpeculation

logger = logging.getLogger(__name__)


class SpeculativeRows:
    """The batching engine's speculative step (a mixin of `BatchingEngine`, kept here so the
    engine module stays about scheduling): rows draft and verify before the batched step."""

    spec: EngineSpeculation | None
    slots: KVSlots
    rows: list[Any]
    max_length: int
    decode_seconds: float
    counters: dict[str, int]

    def _end(self, job: Any, reason: str, error: str | None = None) -> None: ...

    def _record(self, job: Any, choice: tuple[int, TokenLogprobs | None]) -> None: ...

    def _next(self, job: Any, logits: np.ndarray, greedy: int | None) -> None: ...

    def _speculate(self, job: Any) -> bool:
        """One speculative step of `job` on its row; False when it drafted nothing (it then
        decodes in the batched step). Emits accepted + 1 tokens; the rest is rolled back."""
        if job.spec is None or self.spec is None:
            return False
        room, context = self._room_and_context(job)
        t0 = time.perf_counter()
        try:
            step = self.spec.step(job.spec, self.slots, job.row, context, room, job.sampler)
        except Exception as exc:
            logger.exception("speculative step failed")
            self._end(job, "error", f"decode failed: {type(exc).__name__}: {exc}")
            return True
        if step is None:
            return False
        self.decode_seconds += time.perf_counter() - t0
        logits, tokens = step
        self._emit(job, logits, tokens)
        return True

    def _speculate_together(self, live_rows: list[int]) -> bool:
        """One run for every decoding row: rows with drafts verify [last, drafts], the others
        score their one new token in the same run (padded to the step's width; the padding's
        KV lies past what the row keeps). False when no row drafted or a row lacks room: the
        plain batched step then runs. Greedy rows emit exactly plain greedy's tokens."""
        spec = self.spec
        assert spec is not None
        batch = live_rows[-1] + 1
        cap = spec.draft_cap(len(live_rows))
        if not self.slots.fits(batch, 1 + cap):
            return False
        plans: dict[int, tuple[Drafts, list[int]]] = {}
        for r in live_rows:
            job = self.rows[r]
            if job.spec is None:
                continue
            room, context = self._room_and_context(job)
            drafts = spec.propose(job.spec, context, min(room, cap))
            if int(drafts.lengths[0]) > 0:
                plans[r] = (drafts, context)
        if not plans:
            return False
        width = spec.width(
            batch,
            [
                (self.rows[r].spec, int(plans[r][0].lengths[0]) if r in plans else 0)
                for r in live_rows
            ],
        )
        if width == 1:  # a plain batched step pays more than these drafts
            return False
        plans = {r: (truncate_drafts(d, width - 1), c) for r, (d, c) in plans.items()}
        ids = np.zeros((batch, width), dtype=np.int64)
        live = np.zeros(batch, dtype=bool)
        for r in live_rows:
            last = self.rows[r].tokens[-1]
            row = [last, *plans[r][0].row(0)] if r in plans else [last]
            ids[r] = row + [last] * (width - len(row))
            live[r] = True
        start = self.slots.lengths[:batch].copy()
        t0 = time.perf_counter()
        try:
            logits = self.slots.verify_rows(ids, live)
        except Exception as exc:
            logger.exception("speculative step failed")
            self.slots.lengths[:batch] = start
            for r in live_rows:
                self._end(self.rows[r], "error", f"decode failed: {type(exc).__name__}: {exc}")
            return True
        elapsed = time.perf_counter() - t0
        self.decode_seconds += elapsed
        if spec.cost is not None:
            spec.cost.observe(ids.size, elapsed, verify=True)
        spec.counters["spec_batched_steps"] += 1
        self.counters["decode_steps"] += 1
        self.counters["decode_rows"] += len(live_rows)
        self.counters["decode_batch_rows"] += batch
        for r in live_rows:
            job = self.rows[r]
            if r not in plans:
                self.slots.keep(r, int(start[r]) + 1)
                self._next(job, logits[r, :1], None)
                continue
            drafts, context = plans[r]
            try:
                width = int(drafts.lengths[0]) + 1
                result = job.spec.verifier.chain(drafts, logits[r : r + 1, :width], (context,))
            except Exception as exc:
                logger.exception("request %s failed", job.handle.request.request_id)
                self._end(job, "error", f"{type(exc).__name__}: {exc}")
                continue
            self.slots.keep(r, int(start[r]) + int(result.accepted[0]) + 1)
            spec.observe(job.spec, drafts, result, {})
            self._emit(job, logits[r], result.tokens[0])
        return True

    def _room_and_context(self, job: Any) -> tuple[int, list[int]]:
        """How many drafts `job` may verify (its token budget and its row's KV space) and its
        ids so far (prompt + generated; the last one has no KV yet)."""
        pos = int(self.slots.lengths[job.row])  # == len(prompt) + len(tokens) - 1
        room = min(job.budget - len(job.tokens) - 1, self.max_length - 1 - pos)
        return room, [*job.prompt.tolist(), *job.tokens]

    def _emit(self, job: Any, logits: np.ndarray, tokens: list[int]) -> None:
        """Record a verified row's tokens (logits [S, V] of its positions) until it finishes."""
        k = job.handle.request.logprobs
        for i, token in enumerate(tokens):
            self._record(job, (token, None if k is None else token_logprobs(logits[i], token, k)))
            if self.rows[job.row] is not job:  # finished (EOS, length, stop string)
                break

    def _observe_plain(self, job: Any, row: int, extra: dict[str, np.ndarray]) -> None:
        """`job` decoded one token in the batched step (row `row` of its outputs `extra`)."""
        if job.spec is not None and self.spec is not None and self.rows[row] is job:
            outputs = {name: value[row : row + 1] for name, value in extra.items()}
            self.spec.observe_plain(job.spec, outputs, job.tokens[-1])


def truncate_drafts(drafts: Drafts, k: int) -> Drafts:
    """The first `k` drafts of a one-row `Drafts` (unchanged when it has no more)."""
    if drafts.width <= k:
        return drafts
    return Drafts(
        drafts.tokens[:, :k],
        np.minimum(drafts.lengths, k),
        None if drafts.probs is None else drafts.probs[:, :k],
    )
