"""What happens to a batching engine's row once it decodes: its next token, and its end.

`RowTokens` is a mixin of `BatchingEngine` (kept apart so the engine module stays about
scheduling: admission, prefill, compaction, the decode step): it chooses a row's next token
(the graph's argmax or the request's own sampler), records it against EOS, the token budget
and stop strings, and frees the row (its KV stays for the prefix cache) when the request ends,
is cancelled or fails. A failure in one request's sampler or grammar ends that request alone.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from specport.runtime.engine.base import RequestHandle, TokenLogprobs
from specport.runtime.engine.logprobs import token_logprobs
from specport.runtime.engine.prefix_cache import PrefixCache
from specport.runtime.engine.textout import Stream, TextOut
from specport.runtime.sampler import Sampler

if TYPE_CHECKING:
    from specport.runtime.engine.speculation import EngineSpeculation, RowSpec

logger = logging.getLogger(__name__)


@dataclass
class BatchJob:
    """A request admitted to row `row`: its prompt is prefilled up to `done` tokens."""

    handle: RequestHandle
    stream: Stream
    prompt: np.ndarray  # [P] int64
    row: int
    budget: int  # new tokens allowed: min(max_new_tokens, max_length - P)
    sampler: Sampler | None  # None: greedy, the graph's argmax
    eos: frozenset[int]
    done: int = 0  # prompt tokens with KV in the row
    tokens: list[int] = field(default_factory=list)  # generated, in order (last not fed yet)
    spec: RowSpec | None = None  # its speculation state (an engine with `speculative=`)

    @property
    def decoding(self) -> bool:
        return self.done == len(self.prompt)


class RowTokens:
    """Token choice, recording and row release for `BatchingEngine` (see the module docstring).
    It must precede `SpeculativeRows` among the engine's bases: that mixin only declares these
    methods."""

    rows: list[BatchJob | None]
    counters: dict[str, int]
    text: TextOut
    cache: PrefixCache
    spec: EngineSpeculation | None

    def _next(self, job: BatchJob, logits: np.ndarray, greedy: int | None) -> None:
        """Choose and record `job`'s next token; a failure there (its sampler, its grammar)
        ends that request alone with an error: the other rows of the batch go on."""
        try:
            choice = self._choose(job, logits, greedy)
        except Exception as exc:
            logger.exception("request %s failed", job.handle.request.request_id)
            self._end(job, "error", f"{type(exc).__name__}: {exc}")
            return
        self._record(job, choice)

    def _choose(
        self, job: BatchJob, logits: np.ndarray, greedy: int | None
    ) -> tuple[int, TokenLogprobs | None]:
        """The next token of `job` from its logits [1, V] (greedy: the graph's argmax), and
        its logprobs when the request asked for them (from these raw logits)."""
        if job.sampler is None:
            token = greedy if greedy is not None else int(np.argmax(logits[0]))
        else:
            history = generated = None
            if job.sampler.config.needs_history:
                generated = [np.asarray(job.tokens, dtype=np.int64)]
                history = [np.concatenate([job.prompt, generated[0]])]
            token = int(job.sampler(logits, history, generated)[0])
        k = job.handle.request.logprobs
        return token, (None if k is None else token_logprobs(logits[0], token, k))

    def _record(self, job: BatchJob, choice: tuple[int, TokenLogprobs | None]) -> None:
        token, logprob = choice
        job.tokens.append(token)
        self.counters["generated_tokens"] += 1
        finish = None
        if token in job.eos:
            finish = "stop"
        elif len(job.tokens) >= job.budget:
            finish = "length" if job.budget == job.handle.request.max_new_tokens else "context"
        self.text.token(job.stream, token, finish, logprob)
        if finish is not None or job.stream.stopped:  # stopped: inline text found a stop string
            self.counters["finished"] += 1
            self._release(job)

    def _end(self, job: BatchJob, reason: str, error: str | None = None) -> None:
        self.counters["errors" if reason == "error" else "cancelled"] += 1
        self.text.finish(job.stream, reason, error)
        self._release(job)

    def _reject(self, handle: RequestHandle, reason: str, error: str | None = None) -> None:
        self.counters["errors" if reason == "error" else "cancelled"] += 1
        self.text.finish(self.text.open(handle), reason, error)

    def _release(self, job: BatchJob) -> None:
        """Free the row; its KV (prompt + fed tokens) stays there for the prefix cache."""
        if self.rows[job.row] is job:
            self.rows[job.row] = None
            if job.spec is not None and self.spec is not None:
                self.spec.detach(job.spec, job.tokens)
            self.cache.set(
                job.row,
                np.concatenate([job.prompt[: job.done], np.asarray(job.tokens, dtype=np.int64)]),
            )
