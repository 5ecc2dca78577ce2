"""Plain decoding: the engine's one step with no proposer, its KV cache kept between calls.

A `Generator` decodes a batch of prompts until every row has stopped, through the same step
that verifies drafts (`engine.driver.generate_rows` with no proposer: each step runs every live
row's last token once and picks one token per row, `engine.step._decode`), on either KV layout
(`kv.cache.open_kv_cache`). Choosing tokens is the graph's argmax or the caller's `select`
(a Sampler with its per-row histories), and what happens to each new token (streaming, stop
strings) is the `on_token` callback's. Timing separates time inside onnxruntime from wall time,
so the step's own cost is a measured number.

It keeps the cache of its last call and, after a batch-1 call, the ids whose KV that cache's
row holds: a prompt that starts with them (a chat's next turn) prefills only what follows, as
llama.cpp's server and onnxruntime-genai's generator keep a sequence's cache.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from specport.artifact.manifest import Manifest
from specport.runtime.engine.driver import OnRowToken, RowSelect, generate_rows
from specport.runtime.kv.interface import KVCache
from specport.runtime.kv.iobinding import runtime_io
from specport.runtime.kv.layouts import align_kv_dtype

logger = logging.getLogger(__name__)


@dataclass
class GenerationOutput:
    tokens: list[list[int]]  # new tokens per row (EOS included when it ended the row)
    finish_reasons: list[str]  # "eos" | "length" | "stop" | "context"
    metrics: dict[str, Any] = field(default_factory=dict)


class Generator:
    """Batch plain decoding over a session whose graph follows the manifest's I/O contract."""

    def __init__(self, session: Any, manifest: Manifest) -> None:
        self.session = session
        self.manifest = manifest
        self.path = None  # what the driver reads of a model: no file (no drafts to batch)
        align_kv_dtype(session, manifest)  # KV buffers in the graph's type (float16 artifacts)
        # The last batch-1 call's KV and the ids it holds, and the last batched call's KV,
        # kept apart: a batched call no longer drops the batch-1 buffers (2,048 positions,
        # ``driver.BATCH_1_POSITIONS``), which the next batch-1 call would map and fault in
        # again (94 MB for SmolLM2-135M fp32; ``benchmarks.engine_ab``, which alternates
        # generate and generate_batch, measured the cost).
        self.single: KVCache | None = None
        self.held: list[int] | None = None  # the ids ``single``'s row holds
        self.cache: KVCache | None = None  # the last batched call's KV, reused when it fits
        outputs = {o.name for o in session.get_outputs()}
        self._greedy_output = runtime_io(manifest)["next_token_output"] in outputs

    def forget_prompt(self) -> None:
        """The next call reads its whole prompt, even one that starts with the ids this
        generator holds (its buffers are kept): a benchmark's repeated runs of one prompt must
        each time its prefill, as the peers beside it do."""
        self.held = None

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        select: RowSelect | None = None,
        eos_ids: Sequence[int] = (),
        on_token: OnRowToken | None = None,
    ) -> GenerationOutput:
        """Decode ``prompts`` together. ``select(row, logits [1, V]) -> id`` chooses each
        row's token (None: greedy, the graph's argmax where it has one); ``on_token(row,
        token) -> True`` stops that row there (a stop string)."""
        one = len(prompts) == 1
        held = self.held if one else None
        if one:
            self.held = None  # valid again only once this call ends cleanly
        out = generate_rows(
            self,
            prompts,
            max_new_tokens,
            None,
            0,
            eos_ids=eos_ids,
            on_token=on_token,
            cache=self.single if one else self.cache,
            held=held,
            select=select,
        )
        if one:
            self.single, self.held = out.cache, out.held
        else:
            self.cache = out.cache
        out.metrics.update(
            io_binding=self.manifest.kv.layout == "shared",
            greedy_in_graph=select is None and self._greedy_output,
        )
        return GenerationOutput(out.tokens, out.finish_reasons, out.metrics)
