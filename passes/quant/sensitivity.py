"""Each weight's effect on the model's loss, measured by quantizing groups of weights alone.

A size budget trades one tensor's error against another's, so the errors must be in one unit.
The relative output error trace(dW^T H dW) / trace(W^T H W) of a layer is not that unit: a
down projection's error lands on the residual stream, a query's is softened by the softmax,
the LM head's lands on the logits, and early layers' errors travel through every layer after
them. Fixed weights per kind (llama.cpp's Q4_K_M rules, the head weighted 20x) are guesses.

Here the unit is the loss. The weights are grouped by shape (one group per kind of projection:
packed QKV, output, packed gate/up, down; the LM head alone, with a tied embedding table) and
by depth (`bands` equal slices of the layers). For each group, every weight in it is
quantized at 4 bits (RTN, block 32, the planner's cheapest option) and swapped in as a float
initializer of the fp32 graph (onnxruntime's `add_initializer`: no copy of the graph), the
calibration documents run once, and the mean KL(p_float || p_quantized) of the next-token
distributions is the group's loss cost. The planner converts each tensor's relative error to
loss with its group's factor KL / sum(relative error at the measured option): one unit for
every tensor, head and table included. The cost is one session and one pass over a few
calibration documents per group (13 groups for a Llama-class model at 3 bands), memory one
session plus one group's float weights and the float model's log-probabilities of at most
`max_rows` positions.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from specport.passes.quant.blockquant import dequantize
from specport.passes.quant.graph import WeightSite
from specport.passes.quant.rtn import quantize_rtn

logger = logging.getLogger(__name__)

HEAD = "head"
MEASURE_BITS, MEASURE_GROUP = 4, 32  # the option every group is measured at


def group_keys(sites: Sequence[WeightSite], bands: int) -> dict[str, str]:
    """Site name -> group: the LM head alone; body weights by shape and depth band (the
    i-th of n weights of one shape, in graph order, is in band i * bands // n)."""
    by_shape: dict[tuple[int, int], list[WeightSite]] = {}
    keys: dict[str, str] = {}
    for s in sites:
        if s.lm_head:
            keys[s.name] = HEAD
        else:
            by_shape.setdefault((s.k, s.n), []).append(s)
    for (k, n), group in by_shape.items():
        for i, s in enumerate(group):
            keys[s.name] = f"{k}x{n}/{i * bands // len(group)}"
    return keys


def _fake_quantized(site: WeightSite, symmetric: bool) -> np.ndarray:
    """The site's initializer (its own layout: [N, K] when transposed) after 4-bit RTN."""
    w = site.weight_array()
    hat = dequantize(quantize_rtn(w, MEASURE_BITS, MEASURE_GROUP, symmetric))
    return np.ascontiguousarray(hat.T if site.transposed else hat, dtype=np.float32)


def _log_probs(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float32)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def measure_group_kl(
    model_path: Path,
    sites: Sequence[WeightSite],
    sequences: Sequence[np.ndarray],
    feeds: Callable[[ort.InferenceSession, np.ndarray], dict[str, np.ndarray]],
    bands: int = 3,
    symmetric: bool = False,
    max_rows: int = 512,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[dict[str, str], dict[str, dict[str, Any]]]:
    """(site -> group, group -> {"kl", "weights", "seconds"}): the mean next-token KL of the
    float model against the model with one group's weights at 4 bits, on `sequences`."""
    keys = group_keys(sites, bands)
    members: dict[str, list[WeightSite]] = {}
    for s in sites:
        members.setdefault(keys[s.name], []).append(s)
    seqs, rows = [], 0
    for ids in sequences:  # documents until max_rows positions
        if rows >= max_rows:
            break
        seqs.append(ids[: max_rows - rows])
        rows += len(seqs[-1])

    def session(overrides: dict[str, np.ndarray]) -> ort.InferenceSession:
        so = ort.SessionOptions()
        so.log_severity_level = 3
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        # Constant folding would fold a tied head's Transpose(table) from the file's weights
        # before the override applies: the head then scored float and only the gathered table
        # quantized (SmolLM2-135M: KL 0.0056 for its 4-bit head and table, 0.085 measured on
        # a saved copy with both quantized).
        so.add_session_config_entry("optimization.disable_specified_optimizers", "ConstantFolding")
        values = {n: ort.OrtValue.ortvalue_from_numpy(a) for n, a in overrides.items()}
        for name, v in values.items():
            so.add_initializer(name, v)
        sess = ort.InferenceSession(str(model_path), so, providers=["CPUExecutionProvider"])
        sess._specport_keep = values  # type: ignore[attr-defined]  # alive with the session
        return sess

    def run(sess: ort.InferenceSession) -> list[np.ndarray]:
        return [np.asarray(sess.run(["logits"], feeds(sess, ids))[0][0]) for ids in seqs]

    base = [_log_probs(lg) for lg in run(session({}))]
    out: dict[str, dict[str, Any]] = {}
    groups = sorted(members)
    for gi, g in enumerate(groups):
        t0 = time.perf_counter()
        overrides = {
            s.weight.name: _fake_quantized(s, symmetric) for s in members[g] if s.weight.name
        }
        kl, n = 0.0, 0
        for lp, logits in zip(base, run(session(overrides))):
            lq = _log_probs(logits)
            kl += float((np.exp(lp) * (lp - lq)).sum(dtype=np.float64))
            n += lp.shape[0]
        del overrides
        out[g] = {
            "kl": kl / max(n, 1),
            "weights": len(members[g]),
            "seconds": round(time.perf_counter() - t0, 1),
        }
        logger.info("group %s (%d weights): KL %.5f", g, len(members[g]), out[g]["kl"])
        if progress is not None:
            progress(gi + 1, len(groups))
    return keys, out


def loss_factors(
    keys: dict[str, str], group_kl: dict[str, dict[str, Any]], errors: dict[str, float]
) -> dict[str, float]:
    """Site -> factor that turns its relative output error into loss (KL): its group's KL over
    the sum of the group's relative errors at the measured option (`errors`)."""
    sums: dict[str, float] = {}
    for name, g in keys.items():
        sums[g] = sums.get(g, 0.0) + errors.get(name, 0.0)
    floor = 1e-12
    return {
        name: max(group_kl[g]["kl"], floor) / max(sums[g], floor)
        for name, g in keys.items()
        if g in group_kl
    }
