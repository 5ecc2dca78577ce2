"""GGUF tensors -> a Hugging Face `model.safetensors`, written one tensor at a time.

The reader memory-maps the file, so a tensor's bytes are read only while it is converted and
written; the whole model is never held in memory. Float tensors (F32, F16, BF16) are copied as
they are; quantized blocks are dequantized to float32 with the `gguf` package (llama.cpp's own
reference dequantizer). llama.cpp's converter changed two things that are undone here: q/k rows
of Llama-family models are permuted into interleaved rotary pairs, and Gemma's RMSNorm weights
are stored as (1 + w).
"""

from __future__ import annotations

import json
import logging
import struct
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from specport.core.errors import InvalidModelError
from specport.core.progress import track
from specport.exporter.gguf_config import NORM_PLUS_ONE, PERMUTED_QK

logger = logging.getLogger(__name__)

FLOAT_TYPES = {"F32": "F32", "F16": "F16", "BF16": "BF16"}  # GGUF type -> safetensors dtype
DEQUANTIZED = {"Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}
# Tensors that carry rope parameters, read into the config instead of the state dict.
ROPE_TENSORS = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}


@dataclass
class Plan:
    """Which GGUF tensor becomes which HF parameter, and how."""

    hf_names: dict[str, str]  # gguf name -> HF name
    model_type: str
    arch: str
    num_heads: int
    num_kv_heads: int
    report: dict[str, Any] = field(default_factory=dict)


def hf_parameter_names(config_dir: Path) -> list[str]:
    """The state-dict names of the HF model for config.json, built on the meta device (no memory)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(config_dir), local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return list(model.state_dict().keys())


def plan(
    arch: str, model_type: str, cfg: dict, tensors: dict[str, Any], hf_names: list[str]
) -> Plan:
    """Map every GGUF tensor onto an HF parameter with gguf's own tensor-name table."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch_enum = next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch)
    table = get_tensor_name_map(arch_enum, int(cfg["num_hidden_layers"]))
    mapping: dict[str, str] = {}
    for hf in hf_names:
        base, _, suffix = hf.rpartition(".")
        gguf_base = table.get_name(base)
        if gguf_base is not None and f"{gguf_base}.{suffix}" in tensors:
            mapping[f"{gguf_base}.{suffix}"] = hf
    tied = bool(cfg.get("tie_word_embeddings"))
    missing = [
        h for h in hf_names if h not in mapping.values() and not (tied and h == "lm_head.weight")
    ]
    unused = [t for t in tensors if t not in mapping and t not in ROPE_TENSORS]
    if missing or unused:
        raise InvalidModelError(
            f"the GGUF tensors do not match transformers' {model_type} model: missing "
            f"{missing[:3]}{'...' if len(missing) > 3 else ''}, unused {unused[:3]}"
            f"{'...' if len(unused) > 3 else ''}. The file may come from a newer llama.cpp "
            "converter or a variant of the architecture specport does not import."
        )
    return Plan(
        hf_names=mapping,
        model_type=model_type,
        arch=arch,
        num_heads=int(cfg["num_attention_heads"]),
        num_kv_heads=int(cfg["num_key_value_heads"]),
    )


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's `permute` of q/k rows (interleaved rotary pairs -> rotate-half halves)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permuted_heads(p: Plan, gguf_name: str) -> int | None:
    """The head count whose rows llama.cpp permuted in this tensor (q/k of Llama), else None."""
    if p.arch not in PERMUTED_QK:
        return None
    if gguf_name.endswith(("attn_q.weight", "attn_q.bias")):
        return p.num_heads
    if gguf_name.endswith(("attn_k.weight", "attn_k.bias")):
        return p.num_kv_heads
    return None


def _convert(tensor: Any, hf_name: str, p: Plan) -> tuple[np.ndarray, str, str]:
    """(array, safetensors dtype, how) for one tensor; reads its bytes from the memory map."""
    from gguf import GGMLQuantizationType, dequantize

    qtype = tensor.tensor_type.name
    gguf_name = tensor.name
    shape = tuple(int(x) for x in reversed(tensor.shape))  # GGUF lists dimensions innermost first
    plus_one = p.arch in NORM_PLUS_ONE and gguf_name.endswith("norm.weight")
    if qtype in FLOAT_TYPES and not plus_one:
        arr = np.asarray(tensor.data)
        if qtype == "BF16":
            arr = arr.view(np.uint16)
        arr = arr.reshape(shape)
        dtype, how = FLOAT_TYPES[qtype], "kept"
    elif qtype in FLOAT_TYPES or qtype in DEQUANTIZED:
        arr = dequantize(tensor.data, GGMLQuantizationType[qtype]).astype(np.float32, copy=False)
        arr = arr.reshape(shape)
        dtype, how = "F32", "kept" if qtype in FLOAT_TYPES else "dequantized"
        if plus_one:
            arr = arr - np.float32(1.0)
            how = "norm_minus_one"
    else:
        raise InvalidModelError(
            f"GGUF tensor {gguf_name} is stored as {qtype}, which specport cannot dequantize "
            f"(supported: {', '.join([*FLOAT_TYPES, *sorted(DEQUANTIZED)])}). Use a file "
            "quantized with one of those types."
        )
    heads = permuted_heads(p, gguf_name)
    if heads:
        arr = unpermute(arr, heads)
    return np.ascontiguousarray(arr), dtype, how


def _out_dtype(tensor: Any, p: Plan) -> str:
    qtype = tensor.tensor_type.name
    plus_one = p.arch in NORM_PLUS_ONE and tensor.name.endswith("norm.weight")
    return FLOAT_TYPES[qtype] if qtype in FLOAT_TYPES and not plus_one else "F32"


_ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2}


def write_safetensors(
    tensors: dict[str, Any], p: Plan, out: Path, progress: bool | None = None
) -> dict:
    """Stream every mapped tensor into `out` (safetensors layout); returns the manifest report.

    The header needs every tensor's byte range up front; the shapes and output dtypes are known
    from the GGUF header without reading any weights, so it is written first and each tensor's
    bytes follow as they are converted.
    """
    order = sorted(p.hf_names, key=lambda g: p.hf_names[g])
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for g in order:
        t = tensors[g]
        dtype = _out_dtype(t, p)
        shape = [int(x) for x in reversed(t.shape)]
        size = int(np.prod(shape)) * _ITEMSIZE[dtype]
        header[p.hf_names[g]] = {
            "dtype": dtype,
            "shape": shape,
            "data_offsets": [offset, offset + size],
        }
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    types: Counter[str] = Counter()
    how: dict[str, Counter[str]] = {}
    with out.open("wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        desc = "converting GGUF tensors"
        for g in track(order, desc, total=len(order), show=progress):
            t = tensors[g]
            arr, dtype, what = _convert(t, p.hf_names[g], p)
            entry = header[p.hf_names[g]]
            if (
                dtype != entry["dtype"]
                or arr.nbytes != entry["data_offsets"][1] - entry["data_offsets"][0]
            ):
                raise InvalidModelError(
                    f"GGUF tensor {g} has an inconsistent size; the file is corrupt."
                )
            f.write(arr.data)  # contiguous: written without another copy
            types[t.tensor_type.name] += 1
            how.setdefault(t.tensor_type.name, Counter())[what] += 1
    return {
        "tensor_types": dict(sorted(types.items())),
        "conversion": {k: dict(v) for k, v in sorted(how.items())},
        "bytes_written": offset,
    }
