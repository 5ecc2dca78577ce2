"""One request at a time through `Model.generate`: works for every artifact (concat or shared KV).

The fallback engine: no batching, no prefix cache, but exactly the CLI's generation (same
sampler, stop strings), and the one engine that decodes speculatively (`speculative=` "ngram",
"draft" or "mtp", as `specport generate --speculative`: greedy output equals plain greedy,
sampling stays lossless). Text is pushed as `Model.generate` streams it;
the token ids arrive with the final event (the streaming callback sees text only), and so do
the logprobs a request asks for (`logprobs.score`: one run over prompt + answer).
Cancellation is checked before a request starts and whenever it produces text.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

from specport.core.errors import SpecportError
from specport.runtime.engine.base import Event, QueueIntake, RequestHandle
from specport.runtime.engine.logprobs import score

logger = logging.getLogger(__name__)

_CLOSE = object()
REASONS = {"eos": "stop", "stop": "stop", "length": "length", "context": "context"}


class _Cancelled(Exception):
    """Raised from the streaming callback to abandon a cancelled request."""


class SerialEngine(QueueIntake):
    """A queue and a worker thread over `model.generate` (see the module docstring)."""

    def __init__(
        self,
        model: Any,  # specport.api.Model
        speculative: str | None = None,
        num_draft: int | None = None,  # None: the artifact's MTP heads for mtp, else the default
        draft: Any = None,  # a draft Model or artifact path, for speculative="draft"
    ) -> None:
        self.model = model
        self.speculative: dict[str, Any] = {}
        if speculative is not None:
            draft = model.draft_model(draft)  # a path is loaded once, not per request
            self.speculative = {"speculative": speculative, "num_draft": num_draft, "draft": draft}
        self._intake: queue.Queue[Any] = queue.Queue()
        self._closed = False
        self._lock = threading.Lock()
        self.counters = dict.fromkeys(
            ("requests", "finished", "errors", "cancelled", "prompt_tokens", "generated_tokens"), 0
        )
        if speculative is not None:  # vllm:spec_decode_* on /metrics
            self.counters.update(spec_steps=0, spec_draft_tokens=0, spec_accepted_tokens=0)
        self.busy_seconds = 0.0
        self._worker = threading.Thread(target=self._loop, name="specport-serial", daemon=True)
        self._worker.start()

    def close(self) -> None:
        """Cancel what is queued, stop after the running request (it is cancelled too)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending = []
            while True:
                try:
                    pending.append(self._intake.get_nowait())
                except queue.Empty:
                    break
            for handle in pending:
                handle.cancel()
                self._intake.put(handle)
            self._intake.put(_CLOSE)
        self._worker.join()

    def stats(self) -> dict[str, Any]:
        return {
            **self.counters,
            "waiting": self._intake.qsize(),
            "max_batch": 1,
            "busy_seconds": round(self.busy_seconds, 6),
            "speculative": self.speculative.get("speculative") or "off",
        }

    def _loop(self) -> None:
        while True:
            handle = self._intake.get()
            if handle is _CLOSE:
                return
            if handle.cancelled or self._closed:
                self.counters["cancelled"] += 1
                handle.push(Event(finish_reason="cancelled"))
                continue
            t0 = time.perf_counter()
            self._run(handle)
            self.busy_seconds += time.perf_counter() - t0

    def _run(self, handle: RequestHandle) -> None:
        request = handle.request
        config = request.sampling

        def on_text(piece: str) -> None:
            if handle.cancelled or self._closed:
                raise _Cancelled
            if handle.first_token_at is None:
                handle.first_token_at = time.perf_counter()
            handle.push(Event(text=piece))

        try:
            config.validate()
            result = self.model.generate(
                prompt_ids=list(request.prompt_ids),
                max_new_tokens=request.max_new_tokens,
                sampling=config,
                ignore_eos=request.ignore_eos,
                stop=list(request.stop),
                on_text=on_text,
                **self.speculative,
            )
        except _Cancelled:
            self.counters["cancelled"] += 1
            handle.push(Event(finish_reason="cancelled"))
            return
        except Exception as exc:  # the worker must survive any one request
            logger.debug("request failed", exc_info=True)
            self.counters["errors"] += 1
            message = str(exc) if isinstance(exc, SpecportError) else f"{type(exc).__name__}: {exc}"
            handle.push(Event(finish_reason="error", error=message))
            return
        self.counters["finished"] += 1
        self.counters["prompt_tokens"] += len(request.prompt_ids)
        self.counters["generated_tokens"] += len(result.tokens)
        if self.speculative.get("speculative") in (
            "suffix",
            "auto",
        ):  # later requests draft from it
            self.model.suffix_index.learn_answer(result.tokens)
        if "spec_steps" in self.counters:
            m = result.metrics.get("speculative") or {}  # Model.generate nests them here
            self.counters["spec_steps"] += int(m.get("steps", 0))
            self.counters["spec_draft_tokens"] += int(m.get("drafted", 0))
            self.counters["spec_accepted_tokens"] += int(m.get("accepted", 0))
        logprobs = None
        if request.logprobs is not None:
            try:
                logprobs = score(self.model, request.prompt_ids, result.tokens, request.logprobs)
            except Exception as exc:  # the worker must survive any one request
                logger.exception("scoring the logprobs failed")
                self.counters["errors"] += 1
                handle.push(Event(finish_reason="error", error=f"logprobs failed: {exc}"))
                return
        handle.push(
            Event(
                token_ids=list(result.tokens),
                finish_reason=REASONS[result.finish_reason],
                logprobs=logprobs,
            )
        )
