"""Speculative generation behind `Model.generate` / `generate_batch` (speculative=...).

The API checks the arguments first (`specport.generation_args`); these functions wire the
text streams and EOS handling around the runtime's speculative loops and build the results.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from specport.loaded import LoadedArtifact
from specport.results import GenerationResult, row_metrics
from specport.runtime.engine.driver import generate_rows
from specport.runtime.speculative.loop import (
    default_adaptive,
    generate_speculative,
    proposer_factory,
)
from specport.runtime.speculative.tree import generate_tree
from specport.runtime.streaming import TextStreams


def speculative_one(
    model: LoadedArtifact,
    prompt_ids: list[int],
    *,
    max_new_tokens: int,
    sampling: Any,
    ignore_eos: bool,
    stop: Sequence[str],
    on_text: Callable[[str], None] | None,
    method: str,
    num_draft: int,
    draft: LoadedArtifact | None,  # a path already opened (`Model.draft_model`)
    adaptive: bool | None = None,
    tree_width: int = 1,
) -> GenerationResult:

    streams = TextStreams(
        model.tokenizer, 1, list(stop), (lambda row, piece: on_text(piece)) if on_text else None
    )

    def push(tok: int) -> bool:
        return streams.push_row(0, tok)

    # text only during the loop when a callback or a stop string needs it (else ~35 us a token
    # of detokenization between runs); otherwise all at once afterwards, the same text
    on_token = push if streams.needs_steps else None
    eos = [] if ignore_eos else model.manifest.eos_token_ids
    with model.speculative_slot() as slot:
        if tree_width != 1:
            tokens, reason, metrics = generate_tree(
                model,
                prompt_ids,
                max_new_tokens,
                num_draft,
                tree_width,
                sampling,
                eos,
                on_token,
                method=method,
                slot=slot,
            )
        else:
            tokens, reason, metrics = generate_speculative(
                model,
                prompt_ids,
                max_new_tokens,
                method,
                num_draft,
                draft,
                sampling,
                eos,
                on_token,
                adaptive,
                slot,
            )
    if on_token is None:
        streams.push_all([tokens])
    text = streams.finish()[0] if model.tokenizer is not None else ""
    metrics["provider"] = model.provider
    return GenerationResult(list(tokens), text, reason, metrics, prompt_ids)


def speculative_batch(
    model: LoadedArtifact,
    rows: list[list[int]],
    max_new_tokens: int,
    sampling: Any,
    ignore_eos: bool,
    stop: Sequence[str],
    on_text: Callable[[int, str], None] | None,
    method: str,
    num_draft: int,
    draft: LoadedArtifact | None,  # a path already opened (`Model.draft_model`)
    adaptive: bool | None,
) -> list[GenerationResult]:

    streams = TextStreams(model.tokenizer, len(rows), list(stop), on_text)

    on_token = streams.push_row if streams.needs_steps else None  # else all text afterwards
    eos = [] if ignore_eos else model.manifest.eos_token_ids
    # the engine's one step, driven synchronously, on either KV layout
    first, make = proposer_factory(method, model, num_draft, draft)
    out = generate_rows(
        model,
        rows,
        max_new_tokens,
        make,
        num_draft,
        sampling,
        eos,
        on_token,
        default_adaptive(first) if adaptive is None else bool(adaptive),
        method,
    )
    tokens, reasons, metrics = out.tokens, out.finish_reasons, out.metrics
    if on_token is None:
        streams.push_all(tokens)
    texts = streams.finish()
    metrics["provider"] = model.provider
    return [
        GenerationResult(
            list(toks),
            texts[r] if model.tokenizer is not None else "",
            reasons[r],
            row_metrics(metrics, rows[r], toks, r),
            rows[r],
        )
        for r, toks in enumerate(tokens)
    ]
