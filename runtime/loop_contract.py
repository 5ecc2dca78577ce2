"""What the two plain loops (`generator.Generator.generate`'s concat loop and
`bound_loop.run_bound`) share: the selector and callback types, the output and its metrics.

Below both, so the loop module and the class that picks a loop do not import each other.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# select(logits [B, V], step_index) -> ids [B]
Select = Callable[[np.ndarray, int], np.ndarray]
# on_step(new_ids [B], active [B] bool) -> rows that must stop now (e.g. a stop string matched)
OnStep = Callable[[np.ndarray, np.ndarray], "np.ndarray | None"]


@dataclass
class GenerationOutput:
    tokens: list[list[int]]  # new tokens per row (EOS included when it ended the row)
    finish_reasons: list[str]  # "eos" | "length" | "stop" | "context"
    metrics: dict[str, Any] = field(default_factory=dict)


def spare_core(session: Any) -> bool:
    """True when the machine has more cores than the session's intra-op threads."""
    cores = os.cpu_count() or 1
    try:
        threads = int(session.get_session_options().intra_op_num_threads) or cores
    except AttributeError:
        threads = cores
    return cores > threads


def greedy_select(logits: np.ndarray, step: int) -> np.ndarray:
    return np.argmax(logits, axis=-1).astype(np.int64)


def step_metrics(
    batch: int,
    lengths: Sequence[int],
    out_tokens: list[list[int]],
    steps: int,
    t_start: float,
    t_first: float,
    t_end: float,
    decode_ort: float,
) -> dict[str, Any]:
    """The metrics both loops report; overhead = share of decode wall time outside onnxruntime."""
    produced = sum(len(t) for t in out_tokens)
    decode_steps = steps - 1
    decode_wall = t_end - t_first
    return {
        "batch": batch,
        "prompt_tokens": int(sum(lengths)),
        "new_tokens": int(produced),
        "ttft_ms": round((t_first - t_start) * 1e3, 3),
        "prefill_tok_per_s": round(sum(lengths) / max(t_first - t_start, 1e-9), 2),
        "decode_steps": decode_steps,
        "decode_tok_per_s": round(batch * decode_steps / decode_wall, 2) if decode_steps else None,
        "tpot_ms": round(decode_wall / decode_steps * 1e3, 4) if decode_steps else None,
        "decode_ort_s": round(decode_ort, 6),
        "decode_wall_s": round(decode_wall, 6),
        "framework_overhead_pct": round(100 * (1 - decode_ort / decode_wall), 2)
        if decode_steps
        else None,
        "step_overhead_ms": round((decode_wall - decode_ort) / decode_steps * 1e3, 4)
        if decode_steps
        else None,
        "total_s": round(t_end - t_start, 6),
    }
