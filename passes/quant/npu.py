"""The NPU form of `specport quantize` (`--form npu`): an artifact's calibration text in, a
ready `QuantizeQDQPass` out.

Calibration runs the fp32 artifact as prefills (past length 0) over the documents, so the
past-KV inputs see no values there: they take the ranges of the matching present outputs,
which hold the same tensors one step later. With no text given, the built-in seeded
tiny-stories corpus (core/corpus.py) is used, so the form works offline.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from specport.artifact.manifest import Manifest
from specport.core.contract import prefill_feeds
from specport.core.corpus import generate_corpus
from specport.core.errors import QuantizationError
from specport.passes.quant.calibration import read_documents, tokenize
from specport.passes.quant.layout import calibration_context, shared_prefill_feeds
from specport.passes.quant.qdq import QuantizeQDQPass, Range, collect_ranges

logger = logging.getLogger(__name__)

DEFAULT_DOCS = 64


def default_calibration_docs(n_docs: int = DEFAULT_DOCS) -> list[str]:
    """The built-in calibration text: the seeded synthetic tiny-stories corpus (offline)."""

    return generate_corpus(n_docs, seed=11)


def calibration_feeds(
    model_path: Path,
    manifest: Manifest,
    src: Path,
    calib_files: Sequence[str | os.PathLike[str]] = (),
    max_docs: int = DEFAULT_DOCS,
    max_tokens: int = 256,
) -> list[dict[str, np.ndarray]]:
    """Prefill feeds (batch 1, empty cache) of artifact `src`, one per document of
    `calib_files` (default: `default_calibration_docs`), each cut to `max_tokens`."""
    import onnxruntime as ort

    docs = read_documents(calib_files) if calib_files else default_calibration_docs(max_docs)
    tok = src / "tokenizer.json"
    if not tok.is_file():
        raise QuantizationError(f"{src} has no tokenizer.json; calibration needs its tokenizer")
    context = min(max_tokens, calibration_context(manifest))
    seqs = tokenize(docs[:max_docs], tok, manifest.config.get("bos_token_id"), context)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(str(model_path), so, providers=["CPUExecutionProvider"])
    make = shared_prefill_feeds if manifest.kv.layout == "shared" else prefill_feeds
    feeds = [make(sess, ids) for ids in seqs if ids.size]
    return feeds + late_position_feeds(feeds, calibration_context(manifest))


def late_position_feeds(
    feeds: Sequence[dict[str, np.ndarray]], context: int
) -> list[dict[str, np.ndarray]]:
    """The first feed again with its positions moved to the end of the context window.

    Tensors computed from positions (rotary angles, cos / sin built in the graph) reach values
    at position `context - 1` that short calibration documents never show; a range cut at
    the longest document's length clips them, and every later token's rotary phase with
    them (measured on stories260K: +2.5% perplexity on held-apart text instead of +0.3%).
    """
    if not feeds or "position_ids" not in feeds[0]:
        return []
    first = dict(feeds[0])
    pos = first["position_ids"]
    shift = max(context - 1 - int(pos.max()), 0)
    if shift == 0:
        return []
    first["position_ids"] = pos + shift
    return [first]


def kv_input_ranges(manifest: Manifest, ranges: dict[str, Range]) -> dict[str, Range]:
    """`ranges` plus each past-KV input with its present output's range."""
    out = dict(ranges)
    for past, present in zip(manifest.kv.inputs, manifest.kv.outputs):
        for p, q in zip(past, present):
            if q in ranges and p not in ranges:
                out[p] = ranges[q]
    return out


def npu_qdq_pass(
    model_path: Path,
    manifest: Manifest,
    src: Path,
    calib_files: Sequence[str | os.PathLike[str]],
    bits: int,
    group_size: int,
    max_docs: int = DEFAULT_DOCS,
    progress: Callable[[str, int, int], None] | None = None,
) -> QuantizeQDQPass:
    """The QDQ pass for artifact `src`: uint16 activations calibrated on the text, symmetric
    weights per output channel, int8 (bits 8) or int4 (bits 4).

    Why per-channel int4 and not blocks of `group_size` (more accurate on the CPU): on the QNN
    HTP emulator (onnxruntime-qnn 2.7.0, SoC 60) a blocked int4 DequantizeLinear loads with no
    CPU fallback but computes wrong numbers (stories260K prefill: logits 130-150% of the
    largest logit away from the same graph on the CPU provider, per-channel int4 0.7%), and
    MatMulNBits is refused where K is not a multiple of its block. `group_size` is kept for
    the record and unused."""
    if progress:
        progress("calibrating activation ranges", 0, 1)
    feeds = calibration_feeds(model_path, manifest, src, calib_files, max_docs)
    ranges = kv_input_ranges(manifest, collect_ranges(model_path, feeds))
    logger.info("npu form: %d ranges from %d sequences", len(ranges), len(feeds))
    # Positions and the mask stay float where the graph builds rotary angles and the additive
    # mask from them: their range is the whole context (8k positions on uint16: a step of
    # 0.125 position, 0.125 rad at the highest rotary frequency). The qnn target's static
    # graphs read cos/sin from tables instead (quantized as constants).
    keep = [
        n for n in ("position_ids", "attention_mask") if n in {v.name for v in _inputs(model_path)}
    ]
    return QuantizeQDQPass(ranges, weight_bits=bits, block_size=0, keep_float_from=keep)


def _inputs(model_path: Path) -> list[Any]:
    import onnx

    return list(onnx.load(str(model_path), load_external_data=False).graph.input)
