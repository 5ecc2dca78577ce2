"""What a generation returns: `GenerationResult`, one per prompt, with its own metrics."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class GenerationResult:
    """One row's result; `Model.generate_batch` returns one per prompt."""

    tokens: list[int]  # new token ids
    text: str
    finish_reason: str
    metrics: dict[str, Any] = field(default_factory=dict)
    prompt_ids: list[int] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "metrics": self.metrics,
        }


def row_metrics(
    batch: dict[str, Any], prompt: Sequence[int], tokens: Sequence[int], row: int | None = None
) -> dict[str, Any]:
    """One row's metrics: its own token counts, the batch's timings and totals beside them."""
    metrics = dict(batch)
    metrics["batch_prompt_tokens"] = batch.get("prompt_tokens")
    metrics["batch_new_tokens"] = batch.get("new_tokens")
    metrics["prompt_tokens"] = len(prompt)
    metrics["new_tokens"] = len(tokens)
    spec = batch.get("speculative")
    if isinstance(spec, dict) and row is not None and isinstance(spec.get("rows"), list):
        metrics["speculative"] = {**spec, "row": spec["rows"][row]}
    return metrics
