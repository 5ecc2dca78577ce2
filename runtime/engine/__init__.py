"""Request engines: many concurrent generation requests over one loaded artifact (the server's core).

`make_engine(model)` picks the engine the artifact can run: continuous batching with prefix
caching (`BatchingEngine`) for a shared-KV artifact, one request at a time (`SerialEngine`)
otherwise.
"""

from __future__ import annotations

from typing import Any

from specport.core.errors import ArtifactError, InputError
from specport.runtime.engine.admission import DEFAULT_PREEMPTION, PREEMPTION_MODES
from specport.runtime.engine.base import Engine
from specport.runtime.engine.prefill_pace import STALL as PREFILL_STALL

__all__ = ["ENGINE_KINDS", "make_engine"]

ENGINE_KINDS = ("auto", "batching", "serial")


def make_engine(
    model: Any,  # specport.api.Model
    max_batch: int | None = None,
    kind: str = "auto",
    max_length: int | None = None,
    prefix_cache: bool = True,
    speculative: str | None = None,
    num_draft: int | None = None,
    draft: Any = None,
    spec_max_rows: int | None = None,
    spec_max_tokens: int | None = None,
    kv_space: int | None = None,
    prefill_stall: float | None = PREFILL_STALL,
    preemption: str = DEFAULT_PREEMPTION,
) -> Engine:
    """The engine for `model`: "batching" (shared KV layout), "serial" (any), or "auto".

    "auto" batches when the artifact has the shared layout and `max_batch` > 1 (with
    `speculative`: whenever it has the shared layout); `speculative` ("ngram" | "draft" |
    "mtp") makes every request draft and verify: in the batching engine's rows on a shared
    artifact (rows verify one by one while at most `spec_max_rows` decode, else together in
    one run at the width the measured step cost favours, rows x (1 + drafts) <=
    `spec_max_tokens`), in the serial engine on a
    concat one. `max_length` caps the batching engine's KV rows (default: the artifact's
    limit). `max_batch` None: the batching engine reserves rows by memory and admits
    requests within `kv_space` bytes of KV (`kv_budget`); the serial engine runs one at a time.
    `prefill_stall`: the batching engine's bound on how much a round's prefill may delay the
    decoding rows, in decode steps (`prefill_pace`; None: a fixed token budget).
    `preemption`: the batching engine's admission, "none" (each request reserves its prompt +
    max tokens) or "recompute" (what it holds now; the newest request is preempted when the
    KV space runs out, `admission`).
    """
    if preemption not in PREEMPTION_MODES:
        raise InputError(
            f"unknown preemption mode {preemption!r}; use one of {', '.join(PREEMPTION_MODES)}."
        )
    if kind not in ENGINE_KINDS:
        raise InputError(f"unknown engine kind {kind!r}; use one of {', '.join(ENGINE_KINDS)}.")
    shared = model.manifest.kv.layout == "shared"
    if speculative is not None and (kind == "serial" or (kind == "auto" and not shared)):
        # num_draft None: the artifact's MTP heads for mtp, else the generator's default.
        from specport.runtime.engine.serial import SerialEngine

        return SerialEngine(model, speculative=speculative, num_draft=num_draft, draft=draft)
    if kind == "batching" and not shared:
        raise ArtifactError(
            f"the batching engine needs a shared-KV artifact but {model.path} has the "
            f"{model.manifest.kv.layout!r} KV layout: re-export it with "
            "`specport export MODEL --out OUT --kv-layout shared`, or use the serial engine."
        )
    if kind == "batching" or (
        kind == "auto" and shared and (max_batch is None or max_batch > 1 or speculative)
    ):
        from specport.runtime.engine.batching import BatchingEngine
        from specport.runtime.engine.speculation import SPEC_MAX_ROWS, SPEC_MAX_TOKENS

        return BatchingEngine(
            model,
            max_batch=max_batch,
            max_length=max_length,
            prefix_cache=prefix_cache,
            speculative=speculative,
            num_draft=num_draft,
            draft=draft,
            spec_max_rows=SPEC_MAX_ROWS if spec_max_rows is None else spec_max_rows,
            spec_max_tokens=SPEC_MAX_TOKENS if spec_max_tokens is None else spec_max_tokens,
            kv_space=kv_space,
            prefill_stall=prefill_stall,
            preemption=preemption,
        )
    from specport.runtime.engine.serial import SerialEngine

    return SerialEngine(model)
