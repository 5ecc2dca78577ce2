"""Plain (non-speculative) generation behind `Model.generate` / `generate_batch`.

The API checks the arguments first (`specport.generation_args`); this wires the sampler, the
per-row histories that presence / frequency penalties need, the text streams and EOS handling
around the runtime's `Generator`, and builds one result per row. Its speculative counterpart is
`specport.speculative_calls`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from specport.loaded import LoadedArtifact
from specport.results import GenerationResult, row_metrics
from specport.runtime.loop_contract import greedy_select
from specport.runtime.sampler import Sampler
from specport.runtime.streaming import TextStreams


def plain_batch(
    model: LoadedArtifact,
    rows: list[list[int]],
    *,
    max_new_tokens: int,
    config: Any,  # a runtime.sampler.SamplingConfig
    ignore_eos: bool,
    stop: Sequence[str],
    on_text: Callable[[int, str], None] | None,
) -> list[GenerationResult]:
    """Generate for `rows` (prompt token ids) together; one result per row."""

    sampler = Sampler(config, model.manifest.vocab_size)
    history = [np.asarray(r, dtype=np.int64) for r in rows]
    generated = [np.zeros(0, dtype=np.int64) for _ in rows]  # presence / frequency count these
    needs_history = config.needs_history

    def select(logits: np.ndarray, step: int) -> np.ndarray:
        if not needs_history:
            return sampler(logits)
        return sampler(logits, history, generated)

    if config.greedy and config.plain:
        select = greedy_select  # lets a fused graph pick the token in-graph (argmax there)

    streams = TextStreams(model.tokenizer, len(rows), list(stop), on_text)

    def on_step(new: np.ndarray, active: np.ndarray) -> np.ndarray | None:
        if needs_history:
            for r in np.flatnonzero(active):
                history[r] = np.append(history[r], new[r])
                generated[r] = np.append(generated[r], new[r])
        return streams.push(new, active)

    eos = [] if ignore_eos else model.manifest.eos_token_ids
    per_step = needs_history or streams.needs_steps
    with model.plain_generator() as gen:
        out = gen.generate(
            rows, max_new_tokens, select=select, eos_ids=eos, on_step=on_step if per_step else None
        )
    if not per_step:
        streams.push_all(out.tokens)
    texts = streams.finish()
    out.metrics["provider"] = model.provider
    results = []
    for r, toks in enumerate(out.tokens):
        text = texts[r] if model.tokenizer is not None else ""
        metrics = row_metrics(out.metrics, rows[r], toks)
        results.append(GenerationResult(toks, text, out.finish_reasons[r], metrics, rows[r]))
    return results
