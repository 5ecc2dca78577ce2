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
from specport.runtime.engine.driver import RowSelect
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

    streams = TextStreams(model.tokenizer, len(rows), list(stop), on_text)
    select: RowSelect | None = None  # plain greedy: the graph's argmax where it has one
    if not (config.greedy and config.plain):
        sampler = Sampler(config, model.manifest.vocab_size)
        history = [np.asarray(r, dtype=np.int64) for r in rows]
        generated = [np.zeros(0, dtype=np.int64) for _ in rows]  # presence / frequency count these

        def sample(row: int, logits: np.ndarray) -> int:  # logits [1, V]
            if not config.needs_history:
                return int(sampler(logits)[0])
            token = int(sampler(logits, history[row : row + 1], generated[row : row + 1])[0])
            history[row] = np.append(history[row], token)
            generated[row] = np.append(generated[row], token)
            return token

        select = sample

    eos = [] if ignore_eos else model.manifest.eos_token_ids
    # text during the loop only when a callback or a stop string needs it (else ~35 us a token
    # of detokenization between runs); otherwise all at once afterwards, the same text
    on_token = streams.push_row if streams.needs_steps else None
    with model.plain_generator() as gen:
        out = gen.generate(rows, max_new_tokens, select=select, eos_ids=eos, on_token=on_token)
    if on_token is None:
        streams.push_all(out.tokens)
    texts = streams.finish()
    out.metrics["provider"] = model.provider
    results = []
    for r, toks in enumerate(out.tokens):
        text = texts[r] if model.tokenizer is not None else ""
        metrics = row_metrics(out.metrics, rows[r], toks)
        results.append(GenerationResult(toks, text, out.finish_reasons[r], metrics, rows[r]))
    return results
