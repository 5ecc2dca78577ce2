"""Check an exported graph against PyTorch on fresh random prompts.

Cases cover what breaks KV-cache exports in practice: prefill with past length 0, batch > 1
with left padding, and decode steps that feed the graph's own present KV back in. The errors
land in the manifest, and the export fails when they exceed tolerance.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specport.exporter.wrapper import FlatKVWrapper, kv_input_names

logger = logging.getLogger(__name__)


@dataclass
class VerifyCase:
    name: str
    logits_max_abs: float
    kv_max_abs: float
    logits_scale: float


def _feeds(
    ids: np.ndarray, mask: np.ndarray, pos: np.ndarray, past: list[np.ndarray], num_layers: int
) -> dict[str, np.ndarray]:
    feeds = {"input_ids": ids, "attention_mask": mask, "position_ids": pos}
    feeds.update(dict(zip(kv_input_names(num_layers), past)))
    return feeds


def positions_from_mask(mask: np.ndarray, seq: int) -> np.ndarray:
    """Position ids of the last `seq` columns of a left-padded mask [B, T] (pads get 0)."""
    pos = np.cumsum(mask, axis=1) - 1
    pos = np.where(mask > 0, pos, 0)
    return pos[:, -seq:].astype(np.int64)


def verify_export(
    session: Any,
    model: torch.nn.Module,
    kv_shapes: list[tuple[int, int, int]],
    vocab_size: int,
    seed: int = 0,
    atol: float = 1e-4,
    rtol: float = 1e-4,
) -> dict[str, Any]:
    """Run `session` and the PyTorch `model` on the same random inputs; return a report.

    The report has one entry per case and `ok` (every case within atol + rtol * max|logits|).
    """
    rng = np.random.default_rng(seed)
    num_layers = len(kv_shapes)
    wrapper = FlatKVWrapper(model, num_layers).eval()
    cases: list[VerifyCase] = []

    def run_both(
        name: str, ids: np.ndarray, mask: np.ndarray, past: list[np.ndarray]
    ) -> list[np.ndarray]:
        pos = positions_from_mask(mask, ids.shape[1])
        ort_out = session.run(None, _feeds(ids, mask, pos, past, num_layers))
        with torch.no_grad():
            ref = wrapper(
                torch.from_numpy(ids),
                torch.from_numpy(mask),
                torch.from_numpy(pos),
                *[torch.from_numpy(p) for p in past],
            )
        valid = mask[:, -ids.shape[1] :].astype(bool)  # logits at pad positions are meaningless
        ref_logits = ref[0].numpy()
        diff = np.abs(ort_out[0] - ref_logits)[valid]
        kv_diff = max(
            float((np.abs(o - r.numpy()) * mask[:, None, :, None]).max(initial=0.0))
            for o, r in zip(ort_out[1:], ref[1:])
        )
        cases.append(
            VerifyCase(
                name,
                float(diff.max(initial=0.0)),
                kv_diff,
                float(np.abs(ref_logits[valid]).max(initial=1.0)),
            )
        )
        return ort_out

    empty = [np.zeros((1, h, 0, d), np.float32) for h, kd, vd in kv_shapes for d in (kd, vd)]
    ids = rng.integers(0, vocab_size, (1, 7))
    run_both("prefill_b1", ids, np.ones((1, 7), np.int64), empty)

    batch, seq, pad = 2, 6, 2
    ids = rng.integers(0, vocab_size, (batch, seq))
    mask = np.ones((batch, seq), np.int64)
    mask[0, :pad] = 0
    empty2 = [np.zeros((batch, h, 0, d), np.float32) for h, kd, vd in kv_shapes for d in (kd, vd)]
    out = run_both("prefill_b2_leftpad", ids, mask, empty2)
    for step in range(2):
        ids = rng.integers(0, vocab_size, (batch, 1))
        mask = np.concatenate([mask, np.ones((batch, 1), np.int64)], axis=1)
        out = run_both(f"decode_b2_step{step}", ids, mask, list(out[1:]))
    ids = rng.integers(0, vocab_size, (batch, 3))
    mask = np.concatenate([mask, np.ones((batch, 3), np.int64)], axis=1)
    run_both("chunk_b2_past", ids, mask, list(out[1:]))

    ok = all(c.logits_max_abs <= atol + rtol * c.logits_scale for c in cases)
    report = {
        "ok": ok,
        "atol": atol,
        "rtol": rtol,
        "max_abs_logits": max(c.logits_max_abs for c in cases),
        "max_abs_kv": max(c.kv_max_abs for c in cases),
        "cases": [c.__dict__ for c in cases],
    }
    logger.info("verify: ok=%s max_abs_logits=%.3g", ok, report["max_abs_logits"])
    return report


def verify_artifact_files(model_path: Path) -> None:
    """Cheap structural check: the ONNX file loads and passes the checker."""
    import onnx

    onnx.checker.check_model(str(model_path), full_check=False)
