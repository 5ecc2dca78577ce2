"""What every `specport bench` peer shares: the source model it is built from, the precision it
builds with, and the figures it reports.

Below `peers` (which picks a peer by name) and the peers in modules of their own
(`peer_llamacpp`, `peer_openvino`), so each of them imports this and none imports `peers`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specport.artifact import manifest as art
from specport.core.errors import InputError
from specport.exporter import source as src_mod

_KEEP: list[Any] = []  # resolved sources whose temp dirs (llama2c conversions) must live on


def source_dir(manifest: art.Manifest) -> Path:
    """The HF model directory the artifact was exported from (errors if it is gone)."""

    original = manifest.source.get("path")
    if not original:
        raise InputError("the artifact's manifest records no source model path; peers need it.")
    source = src_mod.resolve(original)
    _KEEP.append(source)
    return source.path


def genai_precision(manifest: art.Manifest) -> str:
    """onnxruntime-genai's builder precision with the artifact's weight bit width."""
    scheme = str((manifest.quant or {}).get("scheme", "none"))
    if scheme.startswith("w8"):
        return "int8"
    if scheme.startswith("w4"):
        return "int4"
    return "fp32"


def peer_metrics(
    batch: int, plen: int, steps: int, t0: float, t1: float, t2: float
) -> dict[str, Any]:
    """The figures every peer reports, from its start (t0), first token (t1) and end (t2)."""
    decode = t2 - t1
    return {
        "ttft_ms": round((t1 - t0) * 1e3, 3),
        "prefill_tok_per_s": round(batch * plen / max(t1 - t0, 1e-9), 2),
        "decode_steps": steps,
        "tpot_ms": round(decode / steps * 1e3, 4) if steps else None,
        "decode_tok_per_s": round(batch * steps / decode, 2) if steps else None,
    }
