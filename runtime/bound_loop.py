"""The generation loop for `shared`-layout artifacts: bound buffers, in-place KV, overlapped callbacks.

Same contract as `Generator.generate` (it is called from there). What differs from the plain
loop, and why:
- prompts are right-padded (the fused attention derives each row's slots from `seqlens_k`), so a
  row's positions never include padding and batched output equals one-by-one output;
- greedy selection uses the graph's `next_token` output (argmax in onnxruntime), other
  selectors get the bound logits buffer [B, V] (a view, valid until the next step);
- `on_step` (detokenization, stop strings) for token t runs in a worker thread while
  onnxruntime computes step t+1; a row stopped by it discards that one extra token.

Why plain decoding keeps this loop rather than the engine's one step with no proposer
(`engine.driver.generate_rows(..., make_proposer=None)`, which gives the same tokens): the
step's per-token bookkeeping costs host time between runs. Measured with
`python -m benchmarks.plain_paths ART` (the demo model, shared fp32, one thread; host CPU time
outside onnxruntime per new token, both paths interleaved in one process, 2026-11-27, 2-core
box at load average 9.5-9.9): batch 1, 128 tokens, 5 rounds: 114 us here vs 251 us through the
driver (382 vs 288 tok/s); batch 4, 64 tokens: 28 us vs 118 us (1065 vs 591 tok/s).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np

from specport.artifact import Manifest
from specport.runtime.engine.driver import BATCH_1_POSITIONS
from specport.runtime.engine.prefix_cache import common_prefix
from specport.runtime.kv.iobinding import BoundSession
from specport.runtime.loop_contract import (
    GenerationOutput,
    OnStep,
    Select,
    greedy_select,
    step_metrics,
)


class BoundHolder(Protocol):
    """What this loop reads and keeps on its caller (`generator.Generator`) between calls."""

    session: Any
    manifest: Manifest
    context_length: int
    bound: BoundSession | None  # the bound buffers, kept between calls
    held_ids: np.ndarray | None  # the ids whose KV row 0 holds after a batch-1 call


def bound_session(
    gen: BoundHolder, batch: int, max_length: int
) -> tuple[BoundSession, np.ndarray | None]:
    """The generator's bound buffers when they fit (same batch, long enough), else new ones;
    and the ids whose KV row 0 still holds from the last batch-1 call (None: nothing reusable)."""
    cached: BoundSession | None = gen.bound
    held, gen.held_ids = gen.held_ids, None  # valid again only once this call ends cleanly
    if cached is not None and cached.batch == batch and cached.kv.max_length >= max_length:
        cached.reset()
        return cached, held if batch == 1 else None
    if batch == 1:  # room for a chat's next turns (llama.cpp reserves its whole context)
        max_length = min(gen.context_length, max(2 * max_length, BATCH_1_POSITIONS))
    gen.bound = BoundSession(gen.session, gen.manifest, batch, max_length)
    return gen.bound, None


def run_bound(
    gen: BoundHolder,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    budget: int,
    select: Select,
    eos_ids: Sequence[int],
    on_step: OnStep | None,
    pad_id: int,
    overlap: bool = True,
) -> GenerationOutput:
    lengths = np.array([len(p) for p in prompts], dtype=np.int64)
    batch, longest = len(prompts), int(lengths.max())
    ids = np.full((batch, longest), pad_id, dtype=np.int64)
    for row, p in enumerate(prompts):
        ids[row, : len(p)] = p
    bound, held = bound_session(gen, batch, longest + budget)
    # at least one prompt token runs: its logits choose the first new token
    reuse = 0 if held is None else min(common_prefix(held, ids[0]), len(prompts[0]) - 1)
    greedy = select is greedy_select and bound.has_next
    eos = np.array(sorted(set(int(e) for e in eos_ids)), dtype=np.int64)
    out_tokens: list[list[int]] = [[] for _ in range(batch)]
    reasons = ["length"] * batch
    active = np.ones(batch, dtype=bool)
    worker = (
        ThreadPoolExecutor(max_workers=1, thread_name_prefix="specport-on-step")
        if on_step and overlap
        else None
    )

    def choose(logits: np.ndarray, next_ids: np.ndarray | None, step: int) -> np.ndarray:
        if greedy and next_ids is not None:
            return next_ids  # a view of the bound output: read before the next run overwrites it
        return np.asarray(select(logits, step), dtype=np.int64)

    def apply_stops(stop_rows: np.ndarray | None, rows: np.ndarray) -> None:
        if stop_rows is not None:
            for r in np.flatnonzero(stop_rows & rows):
                reasons[r] = "stop"
                active[r] = False
                if int(r) in alive:
                    alive.remove(int(r))

    # The loop body runs between onnxruntime steps with caches cold from the weight stream:
    # plain Python lists and sets for the per-row bookkeeping, numpy only to feed the graph.
    eos_set = set(eos.tolist())
    alive = list(range(batch))  # rows still generating, kept in step with `active`
    try:
        t_start = time.perf_counter()
        if reuse:  # a chat's next turn: only the new part of its prompt runs
            bound.kv.lengths[0] = reuse
            logits, next_ids = bound.continue_prompt(ids[:, reuse:])
        else:
            logits, next_ids = bound.prefill(ids, lengths)
        prefill_ort = bound.ort_seconds
        new = choose(logits, next_ids, 0)
        t_first = time.perf_counter()
        steps = 0
        while True:
            tokens = new.tolist()
            step_rows = active.copy() if on_step is not None else active
            ended = []
            for r in alive:
                out_tokens[r].append(tokens[r])
                if tokens[r] in eos_set:
                    reasons[r] = "eos"
                    ended.append(r)
            pending: Future[Any] | None = None
            if on_step is not None:  # sees this step's rows before EOS retires any
                if worker is not None:
                    pending = worker.submit(on_step, new.copy(), step_rows)
                else:
                    apply_stops(on_step(new, step_rows.copy()), step_rows)
            for r in ended:
                active[r] = False
                if r in alive:
                    alive.remove(r)
            steps += 1
            if not alive or steps >= budget:
                if pending is not None:
                    apply_stops(pending.result(), step_rows)
                if steps >= budget and budget < max_new_tokens:
                    for r in alive:
                        reasons[r] = "context"
                break
            feed = new if len(alive) == batch else np.where(active, new, pad_id)
            logits, next_ids = bound.decode(feed)
            if pending is not None:
                apply_stops(pending.result(), step_rows)
                if not alive:
                    break
            new = choose(logits, next_ids, steps)
        t_end = time.perf_counter()
        if batch == 1:  # row 0's positions hold the prompt and the tokens fed back since
            fed = int(bound.kv.lengths[0])
            gen.held_ids = np.concatenate([ids[0], np.asarray(out_tokens[0], np.int64)])[:fed]
    finally:
        if worker is not None:
            worker.shutdown(wait=True)
    metrics = step_metrics(
        batch,
        lengths.tolist(),
        out_tokens,
        steps,
        t_start,
        t_first,
        t_end,
        bound.ort_seconds - prefill_ort,
    )
    metrics.update(
        {
            "kv_layout": "shared",
            "io_binding": True,
            "greedy_in_graph": greedy,
            "overlapped_callbacks": worker is not None,
            "cached_prompt_tokens": reuse,
        }
    )
    return GenerationOutput(out_tokens, reasons, metrics)
