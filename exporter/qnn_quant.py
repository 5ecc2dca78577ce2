"""QDQ for the qnn target's static graphs: uint16 activations, symmetric per-channel weights.

`--target qnn --quant w8a16|w4a16` quantizes prefill.onnx and decode.onnx with
`passes.quant.qdq.QuantizeQDQPass` (8-bit, or 4-bit per output channel: a blocked int4
DequantizeLinear loads on the HTP emulator with no CPU fallback but computes wrong numbers,
measured on stories260K). Ranges come from running the float static graphs on onnxruntime's CPU
provider over calibration text (default: the built-in corpus): prefill chunks at position 0
and at the end of the context (so position-derived tensors are not clipped), then one decode
step on the past each prefill left. A past input takes its present output's range (the same
tensor one step later).

The two graphs quantize their weights identically (same names, same values): the prefill
graph's are written to `qdq.onnx.data`, and the decode graph is pointed at the same bytes, so
the QDQ weights are on disk once. model.onnx (float, verified) stays for the CPU provider.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from specport.core.errors import ExportError

logger = logging.getLogger(__name__)

SCHEMES = {"w8a16": 8, "w4a16": 4}
QDQ_DATA = "qdq.onnx.data"
MAX_DOCS = 16


def check_scheme(quant: str) -> int:
    if quant not in SCHEMES:
        raise ExportError(
            f"--target qnn quantizes as {' or '.join(SCHEMES)} (QDQ, uint16 activations), "
            f"not {quant!r}."
        )
    return SCHEMES[quant]


def quantize_static(
    directory: Path,
    section: dict[str, Any],
    quant: str,
    bos_token_id: int | None,
    calib_files: Sequence[str | os.PathLike[str]] = (),
) -> dict[str, Any]:
    """Replace the static graphs by their QDQ form (in `directory`); return a report."""
    from specport.passes.quant.qdq import QuantizeQDQPass, collect_ranges, merge_ranges

    bits = check_scheme(quant)
    graphs = {role: directory / name for role, name in section["graphs"].items()}
    prefill_feeds, decode_feeds = _calibration_feeds(
        directory, graphs, section, bos_token_id, calib_files
    )
    ranges = merge_ranges(
        collect_ranges(str(graphs["prefill"]), prefill_feeds),
        collect_ranges(str(graphs["decode"]), decode_feeds),
    )
    for name in list(ranges):
        if name.startswith("present."):
            ranges[name.replace("present.", "past_key_values.", 1)] = ranges[name]
    report: dict[str, Any] = {"scheme": quant, "activations": "uint16", "weight_bits": bits}
    shared: dict[str, ir.Value] = {}
    for role in ("prefill", "decode"):
        model = ir.load(graphs[role])
        result = QuantizeQDQPass(ranges, weight_bits=bits, block_size=0)(model)
        report[role] = {
            k: result.report.get(k)
            for k in ("activations_quantized", "constants_quantized", "unquantized")
        }
        if role == "prefill":
            ir.save(model, graphs[role], external_data=QDQ_DATA)
            for name, value in ir.load(graphs[role]).graph.initializers.items():
                if isinstance(value.const_value, ir.ExternalTensor):
                    shared[name] = value
        else:
            for name, value in model.graph.initializers.items():
                if name in shared and _same(value, shared[name]):
                    value.const_value = shared[name].const_value
            ir.save(model, graphs[role])  # references into qdq.onnx.data stay references
    report["calibration"] = {"prefill_runs": len(prefill_feeds), "decode_runs": len(decode_feeds)}
    return report


def _same(a: ir.Value, b: ir.Value) -> bool:
    x, y = a.const_value, b.const_value
    if x is None or y is None or x.shape != y.shape or x.dtype != y.dtype:
        return False
    return bool(np.array_equal(x.numpy(), y.numpy()))


def _calibration_feeds(
    directory: Path,
    graphs: dict[str, Path],
    section: dict[str, Any],
    bos: int | None,
    calib_files: Sequence[str | os.PathLike[str]],
) -> tuple[list[dict[str, np.ndarray]], list[dict[str, np.ndarray]]]:
    import onnxruntime as ort

    from specport.passes.quant.calibration import read_documents, tokenize
    from specport.passes.quant.npu import default_calibration_docs

    tok = directory / "tokenizer.json"
    if not tok.is_file():
        raise ExportError(f"{directory} has no tokenizer.json: QDQ calibration needs one")
    context, chunk = int(section["context_length"]), int(section["prefill_chunk"])
    docs = read_documents(calib_files) if calib_files else default_calibration_docs(MAX_DOCS)
    seqs = [s for s in tokenize(docs[:MAX_DOCS], tok, bos, chunk + 1) if s.size > 1]
    if not seqs:
        raise ExportError("the calibration text gave no tokens")
    so = ort.SessionOptions()
    so.log_severity_level = 3
    prefill = ort.InferenceSession(str(graphs["prefill"]), so, providers=["CPUExecutionProvider"])
    past = {i.name: i.shape for i in prefill.get_inputs() if i.name.startswith("past_key_values.")}
    outputs = [o.name for o in prefill.get_outputs()]
    prefill_feeds, decode_feeds = [], []
    for k, ids in enumerate(seqs):
        n = min(chunk, ids.size - 1)
        start = 0 if k % 4 else context - chunk - 1  # every 4th at the end of the context
        feeds = _feeds(ids[:n], start, chunk, context, past, filled=0)
        prefill_feeds.append(feeds)
        if start:
            continue
        out = dict(zip(outputs, prefill.run(outputs, feeds)))
        step = _feeds(ids[n : n + 1], n, 1, context, past, filled=n)
        for name in past:
            present = out[name.replace("past_key_values.", "present.", 1)]
            step[name][:, :, :n] = present[:, :, :n]
        decode_feeds.append(step)
    return prefill_feeds, decode_feeds


def _feeds(
    ids: np.ndarray, start: int, width: int, context: int, past: dict[str, Any], filled: int
) -> dict[str, np.ndarray]:
    n = ids.size
    x = np.zeros((1, width), np.int64)
    x[0, :n] = ids
    mask = np.zeros((1, context + width), np.int64)
    mask[0, :filled] = 1
    mask[0, context : context + n] = 1
    feeds = {
        "input_ids": x,
        "position_ids": np.arange(start, start + width, dtype=np.int64)[None],
        "attention_mask": mask,
    }
    for name, shape in past.items():
        feeds[name] = np.zeros([int(d) for d in shape], np.float32)
    return feeds
