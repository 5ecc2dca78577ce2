"""The prefill/decode loop: owns the KV state and the step timing, not how tokens are chosen.

A `Generator` runs a batch of prompts (left-padded) through prefill, then one token per step
until every row has stopped. Choosing tokens is the `select` callable's job (a Sampler), and
what happens to each new token (streaming, stop strings) is the `on_step` callback's. Timing
separates time inside onnxruntime from wall time so framework overhead is a measured number.

Two loops share that contract. Artifacts with the `concat` KV layout run the plain loop
(session.run, present fed back as past). Artifacts with the `shared` layout run the bound loop
(`runtime.iobinding.BoundSession`): KV written in place, only the last position's logits and the
in-graph greedy token leave the graph, and `on_step` (detokenization, stop strings) runs in a
worker thread while onnxruntime computes the next step (onnxruntime releases the GIL).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from specport.artifact import Manifest
from specport.contract import TREE_MASK, causal_tree_mask
from specport.errors import ContextLengthError, InputError
from specport.runtime.bound_loop import run_bound
from specport.runtime.kv.layouts import align_kv_dtype, make_kv_state
from specport.runtime.loop_contract import (
    GenerationOutput,
    OnStep,
    Select,
    greedy_select,
    spare_core,
    step_metrics,
)

logger = logging.getLogger(__name__)


class Generator:
    """Batch generation over a session whose graph follows the manifest's I/O contract."""

    def __init__(self, session: Any, manifest: Manifest) -> None:
        self.session = session
        self.manifest = manifest
        align_kv_dtype(session, manifest)  # KV buffers in the graph's type (float16 artifacts)
        # A shared-layout artifact's KV buffer may be shorter than the model's context.
        limit = manifest.kv.max_length if manifest.kv.layout == "shared" else None
        self.context_length = min(manifest.context_length, limit or manifest.context_length)
        self._output_names = [o.name for o in session.get_outputs()]
        self._tree_mask = TREE_MASK in {i.name for i in session.get_inputs()}  # --tree-mask
        # shared layout: run on_step for token t while onnxruntime computes step t+1 (only pays
        # with a core to spare; on 2 cores / 2 threads it raised overhead from 2.7% to 7.8%)
        self.overlap_callbacks = spare_core(session)
        # shared layout: the bound buffers, kept between calls, and the token ids whose KV
        # row 0 holds after a batch-1 call, so the next call's prompt that starts with them (a
        # chat's next turn) prefills only what follows (`bound_loop.run_bound`)
        self.bound: Any = None
        self.held_ids: np.ndarray | None = None

    def check_fits(self, prompt_lengths: Sequence[int]) -> None:
        longest = max(prompt_lengths)
        if longest >= self.context_length:
            raise ContextLengthError(
                f"prompt has {longest} tokens but the model's context window is {self.context_length} "
                "(the artifact's KV buffer length, for a shared-layout artifact) "
                f"(and at least one new token must fit). Shorten the prompt to at most {self.context_length - 1} tokens."
            )

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        select: Select = greedy_select,
        eos_ids: Sequence[int] = (),
        on_step: OnStep | None = None,
        pad_id: int = 0,
    ) -> GenerationOutput:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise InputError("every prompt needs at least one token.")
        if max_new_tokens < 1:
            raise InputError("--max-new-tokens must be at least 1.")
        vocab = self.manifest.vocab_size
        for p in prompts:
            bad = [t for t in p if not 0 <= int(t) < vocab]
            if bad:
                raise InputError(
                    f"token ids {bad[:5]} are outside the vocabulary (0..{vocab - 1})."
                )
        lengths = [len(p) for p in prompts]
        self.check_fits(lengths)
        batch, longest = len(prompts), max(lengths)
        # Never run past the context window: the last position must stay < context_length.
        budget = min(max_new_tokens, self.context_length - longest)
        if self.manifest.kv.layout == "shared":
            return run_bound(
                self,
                prompts,
                max_new_tokens,
                budget,
                select,
                eos_ids,
                on_step,
                pad_id,
                overlap=self.overlap_callbacks,
            )

        ids = np.full((batch, longest), pad_id, dtype=np.int64)
        mask = np.zeros((batch, longest), dtype=np.int64)
        for row, p in enumerate(prompts):
            ids[row, longest - len(p) :] = p
            mask[row, longest - len(p) :] = 1
        positions = np.where(mask > 0, np.cumsum(mask, axis=1) - 1, 0).astype(np.int64)
        next_pos = positions[:, -1] + 1

        kv = make_kv_state(self.manifest, batch)
        eos = np.array(sorted(set(int(e) for e in eos_ids)), dtype=np.int64)
        out_tokens: list[list[int]] = [[] for _ in range(batch)]
        reasons = ["length"] * batch
        active = np.ones(batch, dtype=bool)
        ort_seconds = 0.0
        decode_ort = 0.0

        t_start = time.perf_counter()
        feeds = {"input_ids": ids, "attention_mask": mask, "position_ids": positions, **kv.feeds()}
        if self._tree_mask:
            feeds[TREE_MASK] = causal_tree_mask(batch, longest)
        t0 = time.perf_counter()
        outputs = self.session.run(self._output_names, feeds)
        ort_seconds += time.perf_counter() - t0
        kv.update(outputs)
        new = select(outputs[0][:, -1, :], 0)
        t_first = time.perf_counter()
        steps = 0
        while True:
            self._record(new, active, out_tokens, reasons, eos)
            if on_step is not None:
                stop_rows = on_step(new, active.copy())
                if stop_rows is not None:
                    for r in np.flatnonzero(stop_rows & active):
                        reasons[r] = "stop"
                        active[r] = False
            active &= ~np.isin(new, eos) if eos.size else active
            steps += 1
            if not active.any() or steps >= budget:
                if steps >= budget and budget < max_new_tokens:
                    for r in np.flatnonzero(active):
                        reasons[r] = "context"
                break
            mask = np.concatenate([mask, np.ones((batch, 1), np.int64)], axis=1)
            feeds = {
                "input_ids": np.where(active, new, pad_id)[:, None].astype(np.int64),
                "attention_mask": mask,
                "position_ids": next_pos[:, None].copy(),
                **kv.feeds(),
            }
            if self._tree_mask:
                feeds[TREE_MASK] = causal_tree_mask(batch, 1)
            next_pos = next_pos + 1
            t0 = time.perf_counter()
            outputs = self.session.run(self._output_names, feeds)
            dt = time.perf_counter() - t0
            ort_seconds += dt
            decode_ort += dt
            kv.update(outputs)
            new = select(outputs[0][:, -1, :], steps)
        t_end = time.perf_counter()

        metrics = step_metrics(
            batch, lengths, out_tokens, steps, t_start, t_first, t_end, decode_ort
        )
        metrics["kv_layout"] = "concat"
        return GenerationOutput(out_tokens, reasons, metrics)

    @staticmethod
    def _record(
        new: np.ndarray,
        active: np.ndarray,
        out: list[list[int]],
        reasons: list[str],
        eos: np.ndarray,
    ) -> None:
        for r in np.flatnonzero(active):
            tok = int(new[r])
            out[r].append(tok)
            if eos.size and tok in eos:
                reasons[r] = "eos"
