"""Check an exported graph against PyTorch on fresh random prompts.

Cases cover what breaks KV-cache exports in practice: prefill with past length 0, batch > 1
with left padding, single-token decode steps with past KV, and a multi-token chunk on top of a
past. Verification runs in two phases so that the PyTorch model and the onnxruntime session
never hold the weights at the same time (bounded peak memory for large models): first
`reference_cases` records inputs and PyTorch outputs, then `compare` runs the session.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from specport.exporter.wrapper import kv_input_names

logger = logging.getLogger(__name__)


@dataclass
class ReferenceCase:
    name: str
    feeds: dict[str, np.ndarray]
    logits: np.ndarray  # [B, S, V] from PyTorch
    present: list[np.ndarray] = field(default_factory=list)
    valid: np.ndarray | None = None  # [B, S] bool: positions that are real tokens
    kv_mask: np.ndarray | None = None  # [B, T] of the present


def positions_from_mask(mask: np.ndarray, seq: int) -> np.ndarray:
    """Position ids of the last `seq` columns of a left-padded mask [B, T] (pads get 0)."""
    pos = np.cumsum(mask, axis=1) - 1
    pos = np.where(mask > 0, pos, 0)
    return pos[:, -seq:].astype(np.int64)


def reference_cases(
    model: Any, kv_shapes: list[tuple[int, int, int]], vocab_size: int, seed: int = 0
) -> list[ReferenceCase]:
    """Random inputs and the PyTorch wrapper's outputs for each verification case."""
    import torch

    from specport.exporter.wrapper import FlatKVWrapper

    rng = np.random.default_rng(seed)
    num_layers = len(kv_shapes)
    wrapper = FlatKVWrapper(model, num_layers).eval()
    names = kv_input_names(num_layers)
    cases: list[ReferenceCase] = []

    def run(
        name: str, ids: np.ndarray, mask: np.ndarray, past: list[np.ndarray]
    ) -> list[np.ndarray]:
        pos = positions_from_mask(mask, ids.shape[1])
        with torch.no_grad():
            out = wrapper(
                torch.from_numpy(ids),
                torch.from_numpy(mask),
                torch.from_numpy(pos),
                *[torch.from_numpy(p) for p in past],
            )
        arrays = [t.numpy().copy() for t in out]
        feeds = {
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": pos,
            **dict(zip(names, past)),
        }
        valid = mask[:, -ids.shape[1] :].astype(bool)
        cases.append(ReferenceCase(name, feeds, arrays[0], arrays[1:], valid, mask.copy()))
        return arrays[1:]

    def empty(batch: int) -> list[np.ndarray]:
        return [np.zeros((batch, h, 0, d), np.float32) for h, kd, vd in kv_shapes for d in (kd, vd)]

    run("prefill_b1", rng.integers(0, vocab_size, (1, 7)), np.ones((1, 7), np.int64), empty(1))
    batch, seq, pad = 2, 6, 2
    mask = np.ones((batch, seq), np.int64)
    mask[0, :pad] = 0
    past = run("prefill_b2_leftpad", rng.integers(0, vocab_size, (batch, seq)), mask, empty(batch))
    for step in range(2):
        mask = np.concatenate([mask, np.ones((batch, 1), np.int64)], axis=1)
        past = run(f"decode_b2_step{step}", rng.integers(0, vocab_size, (batch, 1)), mask, past)
    mask = np.concatenate([mask, np.ones((batch, 3), np.int64)], axis=1)
    run("chunk_b2_past", rng.integers(0, vocab_size, (batch, 3)), mask, past)
    return cases


def compare(
    session: Any, cases: list[ReferenceCase], atol: float = 1e-4, rtol: float = 1e-4
) -> dict[str, Any]:
    """Run each case through `session`; ok when every case is within atol + rtol * max|logits|."""
    rows: list[dict[str, Any]] = []
    ok = True
    for case in cases:
        out = session.run(None, case.feeds)
        valid = case.valid if case.valid is not None else np.ones(case.logits.shape[:2], bool)
        scale = float(np.abs(case.logits[valid]).max(initial=1.0))
        err = float(np.abs(out[0] - case.logits)[valid].max(initial=0.0))
        kv_err = 0.0
        if case.kv_mask is not None:
            weight = case.kv_mask[:, None, :, None]
            for o, r in zip(out[1:], case.present):
                kv_err = max(kv_err, float((np.abs(o - r) * weight).max(initial=0.0)))
        within = err <= atol + rtol * scale
        ok &= within
        rows.append(
            {
                "name": case.name,
                "logits_max_abs": err,
                "kv_max_abs": kv_err,
                "logits_scale": scale,
                "ok": within,
            }
        )
    report = {
        "ok": ok,
        "atol": atol,
        "rtol": rtol,
        "max_abs_logits": max(r["logits_max_abs"] for r in rows),
        "max_abs_kv": max(r["kv_max_abs"] for r in rows),
        "cases": rows,
    }
    logger.info("verify: ok=%s max_abs_logits=%.3g", ok, report["max_abs_logits"])
    return report
