"""`--kv-float-layers auto`: the fewest layers to keep float32 so chat answers hold, measured.

GroupQueryAttention's cache bit width is per node, so an int8 cache can keep some layers in
float32. Which ones is measured on the graph being quantized, teacher-forced on calibration
documents rendered as chat exchanges (passes/quant/kv_check.py), against the float cache:
  1. all layers int8: top-1 agreement at or above the threshold -> none kept;
  2. each layer int8 alone: its KL from the float cache ranks the layers;
  3. the k most sensitive layers kept float32, k doubled then bisected, until agreement
     reaches the threshold (at most all but one layer).
Each candidate is the graph proto without weights, its external data read from the calibrated
graph's folder (onnxruntime's `session.model_external_initializers_file_folder_path`), so no
weights are copied or written. On SmolLM2-135M-Instruct the error is spread over the layers
(one layer int8 alone: KL 1e-5 to 2.6e-4; all int8: 2.3e-3). There auto keeps 3 layers
(18, 20, 23: 98.36% -> 99.30% on 8 exchanges), which does not carry over to the 16 chat prompts
of `bench --prompt-set chat` (6 of 16 answers identical; 16 layers float32 give 9 of 16 and
the right France answer): 8 exchanges resolve agreement only coarsely (README).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from specport.artifact.manifest import Manifest
from specport.passes.quant import calibration as C
from specport.passes.quant.kv_cache_shared import GRANULARITIES, kernel_scale
from specport.passes.quant.kv_check import (
    MAX_TOKENS,
    SEQUENCES,
    THRESHOLD,
    chat_exchanges,
    compare_logits,
    prefill_logits,
)
from specport.passes.quant.layout import calibration_context

logger = logging.getLogger(__name__)


def _variant(proto: Any, scales: dict[str, np.ndarray], granularity: str, int8: set[int]) -> Any:
    """A copy of the float graph proto with an int8 cache in the layers `int8`."""
    import onnx
    from onnx import helper, numpy_helper

    m = onnx.ModelProto()
    m.CopyFrom(proto)
    g = m.graph
    quant_type = GRANULARITIES[granularity]
    names: set[str] = set()
    for node in g.node:
        if node.op_type != "GroupQueryAttention" or not node.input[3].startswith(
            "past_key_values."
        ):
            continue
        layer = int(node.input[3].split(".")[1])
        if layer not in int8:
            continue
        while len(node.input) < 14:
            node.input.append("")
        for kind, idx in (("key", 12), ("value", 13)):
            past = next(v for v in g.input if v.name == node.input[3 if kind == "key" else 4])
            dims = past.type.tensor_type.shape.dim
            s = kernel_scale(
                scales[f"present.{layer}.{kind}"], granularity, dims[1].dim_value, dims[3].dim_value
            )
            name = f"/model/layers.{layer}/kv_cache/{kind}/scale"
            g.initializer.append(numpy_helper.from_array(s, name))
            node.input[idx] = name
            names |= {f"past_key_values.{layer}.{kind}", f"present.{layer}.{kind}"}
        node.attribute.extend(
            [
                helper.make_attribute("kv_cache_bit_width", 8),
                helper.make_attribute("k_quant_type", quant_type),
                helper.make_attribute("v_quant_type", quant_type),
            ]
        )
    for v in [*g.input, *g.output]:
        if v.name in names:
            v.type.tensor_type.elem_type = onnx.TensorProto.INT8
    return m


def choose_float_layers(
    model_path: Path,
    scales: dict[str, np.ndarray],
    granularity: str,
    sequences: Sequence[np.ndarray],
    layers: int,
    threshold: float = THRESHOLD,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[list[int], dict[str, Any]]:
    """The layers to keep float32 and what was measured (see the module docstring)."""
    import onnx

    proto = onnx.load(str(model_path), load_external_data=False)
    folder = str(Path(model_path).parent)

    def measure(int8: set[int]) -> dict[str, Any]:
        q = prefill_logits(_variant(proto, scales, granularity, int8), sequences, folder)
        return compare_logits(reference, q)

    reference = prefill_logits(model_path, sequences)
    everything = set(range(layers))
    full = measure(everything)
    report: dict[str, Any] = {"threshold": threshold, "all_int8": full}
    if full["agreement"] >= threshold or layers < 2:
        return [], {**report, "kept": [], "result": full}
    kl = []
    for i in range(layers):
        kl.append(measure({i})["kl"])
        if progress is not None:
            progress(i + 1, layers)
    order = [int(i) for i in np.argsort(-np.asarray(kl), kind="stable")]
    report["layer_kl"] = [round(float(x), 7) for x in kl]
    tried: dict[int, dict[str, Any]] = {}

    def ok(k: int) -> bool:
        tried[k] = measure(everything - set(order[:k]))
        logger.info("int8 KV: %d layers float32 -> agreement %.4f", k, tried[k]["agreement"])
        return bool(tried[k]["agreement"] >= threshold)

    lo, hi = 0, 1  # lo fails; find hi that passes by doubling, then bisect
    while hi < layers - 1 and not ok(hi):
        lo, hi = hi, min(2 * hi, layers - 1)
    if hi == layers - 1 and hi not in tried:
        ok(hi)
    while hi - lo > 1 and tried[hi]["agreement"] >= threshold:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid
    kept = sorted(order[:hi])
    report.update(
        kept=kept,
        result=tried[hi],
        tried={str(k): v["agreement"] for k, v in sorted(tried.items())},
    )
    if tried[hi]["agreement"] < threshold:
        logger.warning(
            "int8 KV: even %d of %d layers float32 give top-1 agreement %.4f < %.2f",
            hi, layers, tried[hi]["agreement"], threshold,
        )  # fmt: skip
    return kept, report


def choose_for_artifact(
    model_path: Path,
    manifest: Manifest,
    src: Path,
    calib_files: Sequence[str | os.PathLike[str]],
    scales: dict[str, np.ndarray],
    granularity: str,
    progress: Callable[[str, int, int], None] | None,
) -> tuple[list[int], dict[str, Any]]:
    """`--kv-float-layers auto`: measured on chat exchanges (plain documents without a
    template) of the calibration text; see passes/quant/kv_select.py."""

    docs = C.read_documents(calib_files)
    context = min(MAX_TOKENS, calibration_context(manifest))
    seqs = chat_exchanges(src, docs, context)
    if not seqs:
        bos = manifest.config.get("bos_token_id")
        seqs = C.tokenize(docs[:SEQUENCES], src / "tokenizer.json", bos, context)
    cb = (lambda i, n: progress("rank kv layers", i, n)) if progress else None
    return choose_float_layers(
        model_path, scales, granularity, seqs,
        len(manifest.kv.num_heads), progress=cb,
    )  # fmt: skip
