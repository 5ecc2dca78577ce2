"""Continuous batching for shared-KV artifacts: requests join and leave the batch between steps.

One worker thread owns the model. Each round it (1) takes new requests, drops cancelled and
stopped ones, (2) admits waiting requests into free KV rows while the KV space takes what they
reserve (`admission`; with `preemption="recompute"` the running requests' reservations grow
first, and the newest is preempted to the front of the queue when they would overrun the
space), the row whose cached ids share the longest prefix with the prompt first
(`PrefixCache`), (3) prefills admitted prompts in groups (a resumed request: its prompt and
tokens so far), and (4) runs one decode step over rows [0, highest busy row]. Tokens go to the `TextOut`
thread, which pushes the events. Per request: its own sampler (seeded), EOS, max_new_tokens,
stop strings and the KV budget ("context"), as `Model.generate`.

Prefill groups: a group is a block of consecutive rows prefilled in one onnxruntime run
(`SharedKVCache.prefill_rows` on the block's contiguous view of the in-place buffers, no
copy), each row's chunk right-padded to the group's longest; the request whose prompt a run
completes gets its first token from it, and the text thread gets those tokens as soon as the
group's run ends. One run reads every weight once where prompts one by one read them once
each: 64 eight-token SmolLM2-135M prompts cost ~1.8 s of CPU in one run, ~4.5 s one by one
(`prefill_plan`). New prompts are first sorted over the rows they were given by the tokens
they still need (`_order_new_rows`: a prefix-cache hit's positions move along, a copy of the
hit), then `prefill_plan.groups` cuts the rows where a separate run costs less than the
padding it saves. A row that already holds KV (a prefix-cache hit, a long prompt's later
chunk) joins a group only on graphs that take batched multi-token steps; on older exports it
runs alone. While rows decode a round prefills at most `prefill_budget` prompt tokens (oldest
requests first, chunks of at most `prefill_chunk` per prompt), and only as many as keep the
decoding rows' next token within `prefill_stall` decode steps by the measured costs
(`prefill_pace`), so their streams keep flowing while a long prompt goes in by pieces;
when none decodes, every admitted prompt is prefilled before the first decode step (groups of
at most `GROUP_TOKENS` padded tokens), as vLLM's scheduler fills a step with prefills up to
its token budget.

Every decode round is the one step (`engine/step.py`: propose -> run once -> verify -> commit)
over the decoding rows. With `speculative=` ("ngram" | "suffix" | "draft" | "mtp") each request
also drafts with its own proposer: a row with drafts verifies in a batch-1 run on its own KV
view while at most `spec_max_rows` rows decode (the others decode together), else every row
runs in one batched run at the width (1 + drafts, rows x width within `spec_max_tokens`) with
the most expected tokens per second of the step cost the engine measures when it starts, or
plainly when a plain step pays more (the compute-bound rule, `runtime/engine/speculation.py`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from specport.core.errors import ArtifactError, InputError, SpecportError
from specport.runtime.engine import prefill_plan, step
from specport.runtime.engine.admission import DEFAULT_PREEMPTION, PREEMPTION_MODES, Admission
from specport.runtime.engine.base import (
    QueueIntake,
    Request,
    RequestHandle,
    TokenLogprobs,
    check_request,
)
from specport.runtime.engine.kv_budget import KVBudget, default_kv_space, plan_rows, token_bytes
from specport.runtime.engine.logprobs import token_logprobs
from specport.runtime.engine.prefill_pace import STALL, PrefillPace
from specport.runtime.engine.prefix_cache import PrefixCache
from specport.runtime.engine.speculation import (
    SPEC_MAX_ROWS,
    SPEC_MAX_TOKENS,
    EngineSpeculation,
    RowSpec,
)
from specport.runtime.engine.step_cost import StepCost
from specport.runtime.engine.textout import Stream, TextOut
from specport.runtime.kv.cache import SharedKVCache, session_takes_batched_steps
from specport.runtime.sampler import Sampler
from specport.runtime.session import spare_core
from specport.runtime.speculative.metrics import overhead_ms

logger = logging.getLogger(__name__)

_CLOSE = object()
COMPACT_MIN_LEFT = 8  # tokens a request must still have to go to be worth moving to a lower row
# KV bytes copied at most to keep a cached prefix while other rows decode (`PrefixCache.plan`'s
# max_save): the copy runs inside their gap. On SmolLM2 fp32 KV beside 4 streams, 115 MB
# (2,500 positions) cost ~58 ms with the pages it first touched, 8-9 usual gaps; 16 MiB is
# about one
COPY_WHILE_DECODING = 16 * 2**20
GROUP_TOKENS = 512  # padded prompt tokens one prefill run holds at most while no row decodes
# Prompt tokens prefilled per round while rows decode (by default). 64 prompts arriving over a
# few rounds (the load test at 64 concurrent, SmolLM2 fp32, ~335 prompt tokens after prefix
# hits): at 256 the last third waited a decode step of ~50 rows, TTFT p99 4.6 s vs 2.2 s at 512
# (in-process replay, load average 5.5-6.7 on 2 cores). A round's prefill stalls the decoding
# rows' next token by its cost (~1.8 s of CPU at 512 tokens on SmolLM2), as a vLLM step filled
# with prefills does.
PREFILL_BUDGET = 512


@dataclass
class BatchJob:
    """A request admitted to row `row` (-1 while it waits): `fill` is prefilled up to `done`
    tokens."""

    handle: RequestHandle
    stream: Stream
    prompt: np.ndarray  # [P] int64
    row: int
    budget: int  # new tokens allowed: min(max_new_tokens, max_length - P)
    sampler: Sampler | None  # None: greedy, the graph's argmax
    eos: frozenset[int]
    done: int = 0  # `fill` tokens with KV in the row
    started: bool = False  # a prefill run wrote its row (its row is then fixed until it decodes)
    tokens: list[int] = field(default_factory=list)  # generated, in order (last not fed yet)
    spec: RowSpec | None = None  # its speculation state (an engine with `speculative=`)
    # the ids to prefill: the prompt; after a preemption, the prompt and the tokens it had
    # generated but the last, which its next step feeds as if it had never stopped
    fill: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    preempted: int = 0  # times it was preempted
    admitted: int = 0  # admission order (the most recent is preempted first)

    def __post_init__(self) -> None:
        if not len(self.fill):
            self.fill = self.prompt

    @property
    def decoding(self) -> bool:
        return self.done == len(self.fill)

    def held_ids(self) -> np.ndarray:
        """The ids whose KV its row holds (the last generated token's once it is fed)."""
        if not self.decoding:
            return self.fill[: self.done]
        rest = self.tokens[len(self.fill) - len(self.prompt) :]
        return np.concatenate([self.fill, np.asarray(rest, dtype=np.int64)])


def _created(job: BatchJob) -> float:
    return job.handle.created


def _admitted(job: BatchJob) -> int:
    return job.admitted


def _handle(item: RequestHandle | BatchJob) -> RequestHandle:
    return item.handle if isinstance(item, BatchJob) else item


def _stopped(item: RequestHandle | BatchJob) -> bool:
    return isinstance(item, BatchJob) and item.stream.stopped


class BatchingEngine(QueueIntake):
    """`max_batch` concurrent requests over one shared-layout model (see the module docstring)."""

    def __init__(
        self,
        model: Any,  # specport.api.Model
        max_batch: int | None = None,
        max_length: int | None = None,
        prefill_chunk: int = 256,
        prefill_budget: int | None = None,
        prefix_cache: bool = True,
        text_thread: bool | None = None,
        speculative: str | None = None,
        num_draft: int | None = None,
        draft: Any = None,
        spec_max_rows: int = SPEC_MAX_ROWS,
        spec_max_tokens: int = SPEC_MAX_TOKENS,
        kv_space: int | None = None,
        prefill_stall: float | None = STALL,
        preemption: str = DEFAULT_PREEMPTION,
    ) -> None:
        """`max_batch`: KV rows (None: as many as `kv_budget.plan_rows` reserves; requests are
        then admitted by `kv_space` bytes of KV, default `kv_budget.default_kv_space`).
        `text_thread`: detokenize on a thread of its own (None: only with a core to spare
        beside onnxruntime's threads; on 2 cores / 2 threads it cost single-request decode 5%).
        `speculative`, `num_draft`, `draft` (a Model or path), `spec_max_rows`: see
        `EngineSpeculation`. `prefill_stall`: while rows decode, a round prefills the prompt
        tokens whose measured cost delays their next token by at most this many decode steps
        in all (`prefill_pace`; None: `prefill_budget` tokens a round, whatever they cost).
        `preemption`: "none" (a request reserves its prompt + token budget when admitted) or
        "recompute" (what it holds now; the newest request is preempted when the space runs
        out, see `admission`)."""
        manifest = model.manifest
        if manifest.kv.layout != "shared":
            raise ArtifactError(
                f"the batching engine needs a shared-KV artifact, {model.path} has the "
                f"{manifest.kv.layout!r} layout: re-export it with "
                "`specport export MODEL --out OUT --kv-layout shared` (or serve it with the "
                "serial engine)."
            )
        if (max_batch is not None and max_batch < 1) or prefill_chunk < 1:
            raise InputError("max_batch and prefill_chunk must be at least 1.")
        if prefill_budget is not None and prefill_budget < 1:
            raise InputError("prefill_budget must be at least 1.")
        if prefill_stall is not None and not prefill_stall > 1:
            raise InputError(f"prefill_stall must be above 1, got {prefill_stall}.")
        if kv_space is not None and kv_space < 1:
            raise InputError("kv_space must be a positive number of bytes.")
        if preemption not in PREEMPTION_MODES:
            raise InputError(
                f"unknown preemption mode {preemption!r}; use one of {', '.join(PREEMPTION_MODES)}."
            )
        limit = min(manifest.context_length, manifest.kv.max_length or manifest.context_length)
        self.max_length = min(max_length or limit, limit)
        max_batch = plan_rows(manifest, self.max_length, max_batch)
        self.budget = KVBudget(kv_space or default_kv_space(), token_bytes(manifest))
        # rows filled to the end fit the space: 2 MiB pages (faster decode) and nothing to
        # count; otherwise 4 KiB pages, committed as written and counted (`KVBudget.fit`)
        whole = max_batch * self.max_length * self.budget.per_token
        self.small_pages = whole > self.budget.space
        self.model, self.max_batch, self.prefill_chunk = model, max_batch, prefill_chunk
        self.prefill_budget = prefill_budget or PREFILL_BUDGET
        self.pace = PrefillPace(prefill_stall)
        self.paced_tokens = 0  # prompt tokens prefilled in this round while rows decoded
        self.vocab = manifest.vocab_size
        self.eos = frozenset(int(e) for e in manifest.eos_token_ids)
        if speculative == "mtp":
            model.ensure_mtp_branch()  # `specport.load` leaves the branch out unless asked
        self.kv = SharedKVCache(
            model.session, manifest, max_batch, self.max_length, small_pages=self.small_pages
        )
        if self.small_pages:
            self.budget.commit = lambda n: int(self.kv.commit_bytes(n))
        self.kv_bytes = sum(b.nbytes for b in self.kv.buffers)
        logger.info(
            "batching engine: %d rows x %d positions (%.1f MiB of address space, on %s pages), "
            "admitting requests within %.1f MiB of KV (%d tokens)",
            max_batch, self.max_length, self.kv_bytes / 2**20,
            "4 KiB" if self.small_pages else "2 MiB", self.budget.space / 2**20,
            self.budget.capacity,
        )  # fmt: skip
        self.cache = PrefixCache(max_batch, enabled=prefix_cache)
        # rows holding KV prefill together only on graphs that take batched multi-token steps
        self.batched_steps = session_takes_batched_steps(
            model.session, Path(model.path) / manifest.model_file
        )
        self.spec = None
        if speculative is not None:
            self.spec = EngineSpeculation(
                model, speculative, num_draft, draft, spec_max_rows, max_tokens=spec_max_tokens
            )
            self.spec.batched = self.batched_steps
            if self.spec.batched and max_batch >= 2 and not self.spec.needs_outputs:
                self.spec.cost = StepCost.calibrate(self.kv, max_batch)
        # a step writes 1 + drafts positions per row: the reservations' lookahead
        lookahead = 1 + (self.spec.num_draft if self.spec is not None else 0)
        self.admission = Admission(preemption, self.max_length, lookahead)
        self._admissions = 0
        self.rows: list[BatchJob | None] = [None] * max_batch
        # new requests, and preempted ones (at the front) with their state
        self.waiting: deque[RequestHandle | BatchJob] = deque()
        if text_thread is None:
            text_thread = spare_core(model.session)
        self.text = TextOut(model.tokenizer, threaded=text_thread)
        self._intake: queue.Queue[Any] = queue.Queue()
        self._closed = False
        self._lock = threading.Lock()
        self.counters = dict.fromkeys(
            (
                "requests", "finished", "errors", "cancelled", "prompt_tokens",
                "prefill_tokens", "generated_tokens", "decode_steps", "decode_rows",
                "decode_batch_rows", "compactions", "busy_steps", "prefill_runs",
                "prefill_padded_tokens", "kv_rows_released", "preemptions",
                "recomputed_tokens",
            ),
            0,
        )  # fmt: skip
        self.decode_seconds = 0.0
        self.busy_seconds = 0.0  # wall time of worker rounds that had rows to serve
        self.busy_ort_seconds = 0.0  # onnxruntime's part of it (not the start-up calibration)
        # Where the engine's CPU goes (thread CPU time, robust to the machine's other load):
        # its worker over busy rounds, and the onnxruntime runs inside them by kind; the rest
        # of the worker's time is its own host work (scheduling, KV bookkeeping, sampling).
        self.cpu = dict.fromkeys(("worker", "decode_ort", "prefill_ort"), 0.0)
        self._worker = threading.Thread(target=self._loop, name="specport-batching", daemon=True)
        self._worker.start()

    # ---- the Engine contract --------------------------------------------------------
    def close(self) -> None:
        """Cancel what is queued or running, deliver the final events, stop the threads."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._intake.put(_CLOSE)
        self._worker.join()
        self.text.close()

    def queued(self) -> int:
        """Requests submitted and not yet given a KV row (waiting for a row or for KV space)."""
        return len(self.waiting) + self._intake.qsize()

    def stats(self) -> dict[str, float | int]:
        c = dict(self.counters)
        steps = max(c["decode_steps"], 1)
        busy = sum(job is not None for job in self.rows)
        return {
            **c,
            **self.cache.stats(),
            "running": busy,
            "waiting": self.queued(),
            "max_batch": self.max_batch,
            "max_length": self.max_length,
            "preemption_mode": self.admission.preemption,
            "kv_bytes": self.kv_bytes,
            "kv_held_bytes": int(self.kv.held_bytes().sum()),
            **self.budget.stats(),
            "mean_decode_rows": round(c["decode_rows"] / steps, 3),
            "mean_decode_batch": round(c["decode_batch_rows"] / steps, 3),
            "decode_seconds": round(self.decode_seconds, 6),
            "ort_seconds": round(self.kv.ort_seconds, 6),
            **self.cpu_split(),
            # the engine step's own cost: busy wall time outside onnxruntime per step
            "step_overhead_ms": overhead_ms(
                self.busy_seconds, self.busy_ort_seconds, c["busy_steps"]
            ),
            **(self.spec.stats() if self.spec is not None else {}),
        }

    def cpu_split(self) -> dict[str, float]:
        """CPU seconds by part (thread CPU time): `engine_cpu_seconds` the worker's busy
        rounds, of which `decode_ort_cpu_seconds` / `prefill_ort_cpu_seconds` inside
        onnxruntime's decode steps / prompt runs and `engine_host_cpu_seconds` the rest;
        `textout_cpu_seconds` the detokenizing thread. What a server process spends beyond
        these is its HTTP side (and start-up): a served token's cost, split."""
        cpu = self.cpu
        return {
            "engine_cpu_seconds": round(cpu["worker"], 6),
            "decode_ort_cpu_seconds": round(cpu["decode_ort"], 6),
            "prefill_ort_cpu_seconds": round(cpu["prefill_ort"], 6),
            "engine_host_cpu_seconds": round(
                cpu["worker"] - cpu["decode_ort"] - cpu["prefill_ort"], 6
            ),
            "textout_cpu_seconds": round(self.text.cpu_seconds, 6),
        }

    # ---- the worker -----------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            busy = any(job is not None for job in self.rows)
            if not self._take(block=not busy and not self.waiting):
                break
            t0, ort0, cpu0 = time.perf_counter(), self.kv.ort_seconds, time.thread_time()
            before = dict(self.counters) if logger.isEnabledFor(logging.DEBUG) else None
            streaming = any(job is not None and job.decoding for job in self.rows)
            self.paced_tokens = 0
            try:
                self._sweep()
                if not self._reserve_steps():  # as vLLM: no admission in a round that preempted
                    self._admit()
                self._prefill()
                self._decode()
            except Exception as exc:  # never let one bad step kill the engine
                logger.exception("engine step failed")
                for job in self.rows:
                    if job is not None:
                        self._end(job, "error", f"{type(exc).__name__}: {exc}")
            if busy or any(job is not None for job in self.rows):
                self.busy_seconds += time.perf_counter() - t0
                self.busy_ort_seconds += self.kv.ort_seconds - ort0
                self.cpu["worker"] += time.thread_time() - cpu0
                self.counters["busy_steps"] += 1
            self.text.flush()  # the round's tokens to the text thread, one wake-up
            if streaming:  # the gap its streams waited, for the next rounds' prefill budget
                self.pace.observe_round(time.perf_counter() - t0, self.paced_tokens)
            if before is not None:
                self._log_round(before, time.perf_counter() - t0)
        for item in self.waiting:
            if isinstance(item, BatchJob):
                self._end(item, "cancelled")
            else:
                self._reject(item, "cancelled")
        for job in self.rows:
            if job is not None:
                self._end(job, "cancelled")

    def _log_round(self, before: dict[str, int], seconds: float) -> None:
        """One debug line per round (`specport serve -vv`): what a scheduling choice did to
        the rounds is read from these, e.g. where a late request's first token waited."""
        delta = {k: v - before.get(k, 0) for k, v in self.counters.items()}
        logger.debug(
            "round %.0f ms: %d waiting, %d rows busy, %d prefill runs (%d tokens, %d padded), "
            "%d decode rows",
            seconds * 1000,
            len(self.waiting),
            sum(job is not None for job in self.rows),
            delta.get("prefill_runs", 0),
            delta.get("prefill_tokens", 0),
            delta.get("prefill_padded_tokens", 0),
            delta.get("decode_rows", 0),
        )

    def _take(self, block: bool) -> bool:
        """Move new requests to `waiting`; False once `close()` was called."""
        try:
            item = self._intake.get() if block else self._intake.get_nowait()
            while True:
                if item is _CLOSE:
                    return False
                self.waiting.append(item)
                item = self._intake.get_nowait()
        except queue.Empty:
            return True

    def _sweep(self) -> None:
        """Drop cancelled requests and rows a stop string ended."""
        for item in [w for w in self.waiting if _handle(w).cancelled or _stopped(w)]:
            self.waiting.remove(item)
            if not isinstance(item, BatchJob):
                self._reject(item, "cancelled")
            elif item.stream.stopped:  # preempted after its last token matched a stop string
                self.counters["finished"] += 1
                self._release(item)
            else:
                self._end(item, "cancelled")
        for job in self.rows:
            if job is None:
                continue
            if job.stream.stopped:  # TextOut already pushed the final event
                self.counters["finished"] += 1
                self._release(job)
            elif job.handle.cancelled:
                self._end(job, "cancelled")

    def _admit(self) -> None:
        """Give waiting requests free rows, in order, while the KV space takes what each
        reserves (`admission`): a preempted request comes first, with its state."""
        while self.waiting:
            free = [r for r, job in enumerate(self.rows) if job is None]
            if not free:
                return
            item = self.waiting.popleft()
            job = item if isinstance(item, BatchJob) else self._job(item)
            if job is None:  # refused
                continue
            need = self.admission.start(len(job.fill), len(job.prompt) + job.budget)
            if not self.budget.admits(need):  # waits until running requests free KV space
                self.waiting.appendleft(job)
                return
            self._place(job, free, need)

    def _job(self, handle: RequestHandle) -> BatchJob | None:
        """A new request's state (None: refused, its error sent)."""
        try:
            prompt, budget, sampler = check_request(handle.request, self.vocab, self.max_length)
        except SpecportError as exc:
            self._reject(handle, "error", str(exc))
            return None
        except Exception as exc:  # e.g. prompt ids that are not integers
            self._reject(handle, "error", f"invalid request: {type(exc).__name__}: {exc}")
            return None
        stream = self.text.open(handle)
        job = BatchJob(handle, stream, prompt, -1, budget, sampler, self._eos(handle.request))
        if self.spec is not None:
            job.spec = self.spec.attach(handle.request.sampling, sampler, budget)
        self.counters["prompt_tokens"] += len(prompt)
        return job

    def _place(self, job: BatchJob, free: list[int], need: int) -> None:
        """Run `job` in a free row reserving `need` positions, its `fill`'s longest prefix
        cached in a row copied in first (`PrefixCache`)."""
        decoding = any(j is not None and j.decoding for j in self.rows)
        max_save = self._copy_while_decoding() if decoding else None
        plan = self.cache.plan(
            job.fill, free, self.kv.lengths, self._live(), max_save, self.kv.written
        )
        row, hit = plan.row, plan.reuse
        if plan.save_to is not None:  # keep the row's cached KV in a free row
            self.kv.copy_prefix(row, plan.save_to, int(self.kv.lengths[row]))
        if plan.source != row:
            self.kv.copy_prefix(plan.source, row, hit)
        self.kv.lengths[row] = hit
        self.budget.reserve(row, need)
        job.row, job.done, job.started = row, hit, False
        if job.preempted:
            self.counters["recomputed_tokens"] += len(job.fill) - hit
        self._admissions += 1
        job.admitted = self._admissions
        self.rows[row] = job
        self._fit_memory()

    def _reserve_steps(self) -> int:
        """With preemption: each decoding row's reservation covers its next step (`Admission.
        grow`); where the reservations would overrun the KV space, the most recently admitted
        requests are preempted first, never the only running one (the reservations are never
        seen over the space: `stats` reads them from another thread). Returns the
        preemptions."""
        if not self.admission.preempts:
            return 0
        budget = self.budget
        grown: dict[int, int] = {}  # row -> the positions it reserves now
        for job in self.rows:
            if job is None or not job.decoding:
                continue
            reserved = budget.reserved[job.row]
            held = int(self.kv.lengths[job.row])
            tokens = self.admission.grow(held, reserved, len(job.prompt) + job.budget)
            if tokens != reserved:
                grown[job.row] = tokens
        if not grown:
            return 0
        over = budget.reserved_bytes - budget.space
        over += sum(
            budget.bytes_for(t) - budget.bytes_for(budget.reserved[r]) for r, t in grown.items()
        )
        running = sorted((job for job in self.rows if job is not None), key=_admitted)
        victims = []
        while over > 0 and len(running) > 1:
            job = running.pop()
            victims.append(job)
            over -= budget.bytes_for(grown.get(job.row, budget.reserved[job.row]))
        for job in victims:
            self._preempt(job)
        for row, tokens in grown.items():
            if self.rows[row] is not None:
                budget.reserve(row, tokens)
        self._fit_memory()
        return len(victims)

    def _preempt(self, job: BatchJob) -> None:
        """Take `job` out of its row to the front of the waiting queue. Readmitted, it prefills
        its prompt and the tokens it has but the last (its row's KV stays for the prefix cache
        until the space needs it), and its next step feeds that last token: the step it would
        have run, so its stream, sampler and proposer (kept with it) go on as if it had never
        stopped: no token is drawn twice, greedy or seeded."""
        logger.debug("preempting request %s", job.handle.request.request_id)
        self.counters["preemptions"] += 1
        self._vacate(job)
        job.fill = np.concatenate([job.prompt, np.asarray(job.tokens[:-1], dtype=np.int64)])
        job.row, job.done, job.started = -1, 0, False
        job.preempted += 1
        self.waiting.appendleft(job)

    def _live(self) -> dict[int, np.ndarray] | None:
        """Busy rows -> the ids whose KV they hold (copy sources for the prefix cache)."""
        if not self.cache.enabled:
            return None
        return {job.row: job.held_ids() for job in self.rows if job is not None and job.done > 0}

    def _eos(self, request: Request) -> frozenset[int]:
        return frozenset() if request.ignore_eos else self.eos

    def _prefill(self) -> None:
        """Prefill admitted prompts in groups of consecutive rows, one run per group
        (`prefill_plan.groups`), first tokens out as each group's run ends: a chunk of at most
        `prefill_chunk` tokens per prompt, at most `prefill_budget` prompt tokens per round
        while rows decode (fewer where `self.pace` measures them too costly; oldest requests
        first), every prompt whole while none does (groups of at most `GROUP_TOKENS` padded
        tokens), with the requests that arrive meanwhile (`_join_arrivals`)."""
        decoding = any(job is not None and job.decoding for job in self.rows)
        paced = self.pace.budget(self.prefill_budget) if decoding else None
        joining = not decoding
        while True:
            budget = paced
            chosen: list[tuple[BatchJob, int]] = []  # (request, prompt tokens it runs now)
            for job in sorted((j for j in self.rows if j is not None), key=_created):
                if job.decoding:
                    continue
                if budget is not None and budget <= 0:
                    break
                n = min(len(job.fill) - job.done, self.prefill_chunk)
                if budget is not None:
                    n = min(n, budget)
                    budget -= n
                chosen.append((job, n))
            if not chosen:
                return
            if decoding:
                self.paced_tokens += sum(n for _, n in chosen)
            self._order_new_rows(chosen)
            jobs = {job.row: job for job, _ in chosen}
            plan = [prefill_plan.Chunk(j.row, int(self.kv.lengths[j.row]), n) for j, n in chosen]
            cap = paced if paced is not None else max(GROUP_TOKENS, self.prefill_chunk)
            groups = prefill_plan.groups(plan, cap, self.max_length, self.batched_steps)
            # the round's groups all run now: the cheapest first, for the most first tokens soonest
            groups.sort(
                key=lambda g: (prefill_plan.padded(g), min(_created(jobs[c.row]) for c in g))
            )
            for group in groups:
                self._prefill_group([jobs[c.row] for c in group], group)
                self.text.flush()  # this group's first tokens now, not at the round's end
            if decoding:
                return
            if joining:
                joining = self._join_arrivals()

    def _join_arrivals(self) -> bool:
        """Admit the requests that arrived while prompts prefilled with no row decoding yet;
        True when one got a row (the caller then looks again after its next pass).

        A burst of requests reaches the engine over the time the first prompt takes to
        prefill (an HTTP server submits each as its handler gets to it). Left to the next
        round, they would find that first request decoding and be paced against its single
        stream (`prefill_pace`): runs of a few dozen tokens, each reading every weight, and
        decode steps of one or two rows. On the chat load test at 16 in flight (SmolLM2-135M
        fp32, one thread, seed 16) that was 71-78 prefill runs of ~115 tokens and 290-300
        decode steps, where joining takes 31-33 runs and 239 steps (the longest answer's) and
        3-9% less server CPU; at 64 in flight 231-232 runs and 441-450 steps became 133-135
        and 383, 2-3% less CPU (2026-12-06, thread CPU time, load 1-2.5). Joining prefills the
        burst as if it had arrived at once; no stream has had a decode step yet, so none is
        stalled. The KV rows and space bound how many join; the first pass that finds none
        ends the joining."""
        if not self._take(block=False):
            self._intake.put(_CLOSE)  # close() was called: the loop sees it next round
            return False
        busy = sum(job is not None for job in self.rows)
        self._admit()
        return sum(job is not None for job in self.rows) > busy

    def _order_new_rows(self, chosen: list[tuple[BatchJob, int]]) -> None:
        """Sort the chosen prompts that no prefill run has touched yet over the rows they
        hold, by the tokens they run now: consecutive rows then hold prompts of similar
        lengths, which group with little padding. A row's prefix-cache hit moves with it
        (`kv.swap` copies those positions; empty rows cost nothing). Only this round's prompts
        move: the rest keep their rows (admission order), so they stay together too."""
        new = [(job, n) for job, n in chosen if not job.started]
        if len(new) < 2:
            return
        rows = sorted(job.row for job, _ in new)
        order = sorted(new, key=lambda jn: (jn[1], _created(jn[0])))
        for target, (job, _) in zip(rows, order):
            if job.row != target:
                self._swap_rows(job.row, target)

    def _swap_rows(self, a: int, b: int) -> None:
        """Exchange two busy rows: their requests, KV, cached ids and KV reservations."""
        self.kv.swap(a, b)
        self.cache.swap(a, b)
        self.budget.swap(a, b)
        ja, jb = self.rows[a], self.rows[b]
        assert ja is not None and jb is not None
        self.rows[a], self.rows[b], ja.row, jb.row = jb, ja, b, a

    def _prefill_group(self, jobs: list[BatchJob], group: list[prefill_plan.Chunk]) -> None:
        """One run over the group's rows; a request whose prompt it completes gets its first
        token from it."""
        ids = np.zeros((len(group), max(c.n for c in group)), dtype=np.int64)
        for i, (job, c) in enumerate(zip(jobs, group)):
            ids[i, : c.n] = job.fill[job.done : job.done + c.n]
        lengths = np.array([c.n for c in group], dtype=np.int64)
        t0, cpu0 = time.perf_counter(), self.kv.ort_cpu_seconds
        try:
            out = self.kv.prefill_rows(group[0].row, ids, lengths)
        except Exception as exc:
            logger.exception("prefill failed")
            for job in jobs:
                self._end(job, "error", f"prefill failed: {type(exc).__name__}: {exc}")
            return
        finally:
            self.cpu["prefill_ort"] += self.kv.ort_cpu_seconds - cpu0
        self.pace.observe_prefill(ids.size, time.perf_counter() - t0)
        self.counters["prefill_runs"] += 1
        self.counters["prefill_padded_tokens"] += ids.size
        for i, (job, c) in enumerate(zip(jobs, group)):
            job.done += c.n
            job.started = True
            self.counters["prefill_tokens"] += c.n
            if job.decoding and not job.tokens:  # a resumed request's next step feeds its last
                greedy = None if out.greedy is None else int(out.greedy[i, -1])
                self._next(job, out.logits[i, -1:], greedy)  # [1, V] a view: used right away

    def _compact(self) -> None:
        """Move the highest decoding row into the lowest free row below it (one per round).

        A decode step runs rows [0, highest busy row]; a request left alone in a high row would
        drag free rows along (on the 32M Llama a batch-8 step costs 2x a batch-1 step). Copying
        its KV down costs about one step, so only requests with `COMPACT_MIN_LEFT` tokens to go
        are moved. The rows swap contents, so the free row's cached prefix survives.
        """
        busy = [r for r, job in enumerate(self.rows) if job is not None]
        free = [r for r, job in enumerate(self.rows) if job is None]
        if not busy or not free or free[0] > busy[-1]:
            return
        job = self.rows[busy[-1]]
        assert job is not None
        if not job.decoding or job.budget - len(job.tokens) < COMPACT_MIN_LEFT:
            return
        old, new = job.row, free[0]
        self.kv.swap(old, new)
        self.cache.swap(old, new)
        self.budget.move(old, new)
        self.rows[old], self.rows[new], job.row = None, job, new
        self.counters["compactions"] += 1
        self._fit_memory()  # the free row may have held more than the request may write

    def _copy_while_decoding(self) -> int:
        """KV positions worth copying to keep a cached prefix while other rows decode:
        `COPY_WHILE_DECODING` bytes' worth, about one usual gap."""
        return max(1, COPY_WHILE_DECODING // max(1, self.budget.per_token))

    def _fit_memory(self) -> None:
        """Keep the KV pages committed within the KV space (`KVBudget.fit`): trim running rows
        to what they may write, then release idle rows' cached KV, least recently used first
        (their prefix-cache entries go with it)."""
        if not self.small_pages:
            return
        idle = [r for r, job in enumerate(self.rows) if job is None]
        idle.sort(key=self.cache.used.__getitem__)
        trims, drop = self.budget.fit(self.kv.held_bytes(), idle)
        for row, keep in trims.items():
            self.kv.release(row, keep)
        for row in drop:
            self.kv.release(row)
            self.cache.set(row, ())
        self.counters["kv_rows_released"] += len(drop)

    def _decode(self) -> None:
        """One step over the decoding rows (see the module docstring for how they group)."""
        self._compact()
        jobs = [job for job in self.rows if job is not None and job.decoding]
        if not jobs:
            return
        spec = self.spec
        speculate = spec is not None and (spec.active(len(jobs)) or spec.together(len(jobs)))
        rows = [self._step_row(job, speculate) for job in jobs]
        if spec is not None and spec.active(len(rows)):
            plain = []
            for job, row in zip(jobs, rows):  # rows with drafts verify alone, at batch 1
                if step.propose([row]) == 0:
                    plain.append((job, row))
                    continue
                self._run([job], [row], 1 + int(row.drafts.lengths[0]), alone=True)
            if plain:
                self._run([j for j, _ in plain], [r for _, r in plain], 1)
            return
        width = 1
        batch = jobs[-1].row + 1
        if spec is not None and spec.together(len(rows)):
            cap = spec.draft_cap(len(rows))
            if self.kv.fits(batch, 1 + cap):
                for row in rows:
                    row.cap = min(row.cap, cap)
                if step.propose(rows) > 0:
                    plans = [(j.spec, int(r.drafts.lengths[0])) for j, r in zip(jobs, rows)]
                    width = spec.width(batch, plans)
        self._run(jobs, rows, width)

    def _step_row(self, job: BatchJob, speculate: bool) -> step.StepRow:
        """`job`'s part in a step: its ids so far, its token choice, its proposer (if any) and
        how many drafts its token budget and KV room allow."""
        pos = int(self.kv.lengths[job.row])  # == len(prompt) + len(tokens) - 1
        row = step.StepRow(
            job.row,
            [*job.prompt.tolist(), *job.tokens] if job.spec is not None else [job.tokens[-1]],
            lambda logits, greedy: self._choose(job, logits, greedy),
        )
        if job.spec is not None and self.spec is not None:
            row.proposer, row.verifier = job.spec.proposer, job.spec.verifier
            row.proposer.share_target_kv(self.kv, job.row)  # rows move (compaction, preemption)
            if speculate:
                room = min(job.budget - len(job.tokens) - 1, self.max_length - 1 - pos)
                row.cap = min(self.spec.num_draft_of(job.spec), room)
        return row

    def _run(
        self, jobs: list[BatchJob], rows: list[step.StepRow], width: int, alone: bool = False
    ) -> None:
        """Run the step over `rows`, emit what each verified, count it."""
        batch = 1 if alone else rows[-1].row + 1
        start = self.kv.lengths.copy()
        t0, cpu0 = time.perf_counter(), self.kv.ort_cpu_seconds
        try:
            verdicts = step.run(self.kv, rows, width, alone)
        except Exception as exc:
            logger.exception("decode step failed")
            self.kv.lengths[:] = start
            for job in jobs:
                self._end(job, "error", f"decode failed: {type(exc).__name__}: {exc}")
            return
        finally:
            self.cpu["decode_ort"] += self.kv.ort_cpu_seconds - cpu0
        elapsed = time.perf_counter() - t0
        self.decode_seconds += elapsed
        spec = self.spec
        if not alone:
            if width == 1:
                self.pace.observe_decode(elapsed)
            if spec is not None and spec.cost is not None:
                spec.cost.observe(batch * width, elapsed, verify=width > 1)
            if width > 1 and spec is not None:
                spec.counters["spec_batched_steps"] += 1
            self.counters["decode_steps"] += 1
            self.counters["decode_rows"] += len(rows)
            self.counters["decode_batch_rows"] += batch
        for job, verdict in zip(jobs, verdicts):
            if verdict.error is not None:
                logger.error("request %s failed: %s", job.handle.request.request_id, verdict.error)
                self._end(job, "error", verdict.error)
                continue
            if verdict.drafted and spec is not None and job.spec is not None:
                spec.count(job.spec, verdict.drafted, verdict.accepted)
            k = job.handle.request.logprobs
            for i, token in enumerate(verdict.tokens):
                logprob = None if k is None else token_logprobs(verdict.logits[i], token, k)
                self._record(job, (token, logprob))
                if self.rows[job.row] is not job:  # finished (EOS, length, stop string)
                    break

    # ---- a row's tokens ---------------------------------------------------------------
    def _next(self, job: BatchJob, logits: np.ndarray, greedy: int | None) -> None:
        """Choose and record `job`'s next token; a failure there (its sampler, its grammar)
        ends that request alone with an error: the other rows of the batch go on."""
        try:
            token = self._choose(job, logits, greedy)
        except Exception as exc:
            logger.exception("request %s failed", job.handle.request.request_id)
            self._end(job, "error", f"{type(exc).__name__}: {exc}")
            return
        k = job.handle.request.logprobs
        self._record(job, (token, None if k is None else token_logprobs(logits[0], token, k)))

    def _choose(self, job: BatchJob, logits: np.ndarray, greedy: int | None) -> int:
        """The next token of `job` from its logits [1, V] (greedy: the graph's argmax)."""
        if job.sampler is None:
            return greedy if greedy is not None else int(np.argmax(logits[0]))
        history = generated = None
        if job.sampler.config.needs_history:
            generated = [np.asarray(job.tokens, dtype=np.int64)]
            history = [np.concatenate([job.prompt, generated[0]])]
        return int(job.sampler(logits, history, generated)[0])

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
        """The request ended: free its row (or it waited, preempted) and its proposer."""
        if job.row < 0 or self.rows[job.row] is job:
            self._vacate(job)
            if job.spec is not None and self.spec is not None:
                self.spec.detach(job.spec, job.tokens)

    def _vacate(self, job: BatchJob) -> None:
        """Free `job`'s row; its KV (prompt + fed tokens) stays there for the prefix cache."""
        if job.row < 0:
            return
        self.rows[job.row] = None
        self.budget.release(job.row)
        self.cache.set(job.row, job.held_ids())
