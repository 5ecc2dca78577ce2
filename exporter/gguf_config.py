"""GGUF metadata -> a Hugging Face `config.json` dict (hyper-parameters, rope, special tokens).

llama.cpp's converter writes a model's hyper-parameters as `{arch}.*` keys and some of its rope
scaling as small tensors (`rope_freqs` for Llama 3, `rope_factors_long/short` for Phi-3
long-rope). This module turns both back into the config transformers' class for the same
architecture expects, so the export path after it is the one every Hugging Face model takes.
Anything it cannot represent exactly raises, naming the key: a silently different config would
export a model that computes something else.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from specport.core.errors import InvalidModelError, UnsupportedArchitectureError
from specport.exporter.config_check import check_gguf_shapes

# GGUF `general.architecture` -> transformers `model_type`.
MODEL_TYPES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "phi3": "phi3",
    "gemma": "gemma",
    "gemma2": "gemma2",
    "gemma3": "gemma3_text",
}
# Families whose llama.cpp converter permutes q/k rows into interleaved rotary pairs.
PERMUTED_QK = {"llama", "mistral"}
# Families whose llama.cpp converter stores RMSNorm weights as (1 + w).
NORM_PLUS_ONE = {"gemma", "gemma2", "gemma3"}


class Metadata:
    """Typed access to a GGUFReader's key/value fields."""

    def __init__(self, reader: Any, path: str) -> None:
        self.reader = reader
        self.path = path
        self.arch = str(self.get("general.architecture", ""))

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        if field is None:
            return default
        return field.contents()

    def arch_key(self, key: str, default: Any = None) -> Any:
        return self.get(f"{self.arch}.{key}", default)

    def need(self, key: str) -> Any:
        value = self.arch_key(key)
        if value is None:
            raise InvalidModelError(
                f"GGUF file {self.path} has no '{self.arch}.{key}' metadata; the file is "
                "incomplete. Re-download it or re-convert it with llama.cpp's convert_hf_to_gguf.py."
            )
        return value


def model_type(meta: Metadata) -> str:
    """The transformers model_type for this file, or a clear error listing what maps."""
    if meta.arch not in MODEL_TYPES:
        raise UnsupportedArchitectureError(
            f"GGUF architecture {meta.arch!r} ({meta.path}) is not supported. Supported GGUF "
            f"architectures: {', '.join(sorted(MODEL_TYPES))}."
        )
    mt = MODEL_TYPES[meta.arch]
    if mt == "llama" and meta.arch_key("attention.sliding_window"):
        mt = "mistral"  # llama.cpp writes Mistral as `llama`; only the window tells them apart
    return mt


def _f32(value: Any) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (1e-05, not 9.99e-06)."""
    return float(str(np.float32(value)))


def hf_config(meta: Metadata, tensors: dict[str, Any], small: dict[str, np.ndarray]) -> dict:
    """The config.json content. `tensors`: name -> ReaderTensor; `small`: rope factor tensors."""
    mt = model_type(meta)
    heads = int(meta.need("attention.head_count"))
    kv = meta.arch_key("attention.head_count_kv", heads)
    if isinstance(kv, list):
        raise InvalidModelError(
            f"GGUF file {meta.path} has per-layer key/value head counts; specport supports one "
            "count for all layers."
        )
    hidden = int(meta.need("embedding_length"))
    head_dim = int(meta.arch_key("attention.key_length", hidden // heads))
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = meta.arch_key("vocab_size") or (len(tokens) if tokens else None)
    if vocab is None:
        vocab = int(tensors["token_embd.weight"].shape[-1])
    cfg: dict[str, Any] = {
        "model_type": mt,
        "architectures": [_class_name(mt)],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(meta.need("feed_forward_length")),
        "num_hidden_layers": int(meta.need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv),
        "head_dim": head_dim,
        "max_position_embeddings": int(meta.arch_key("context_length", 2048)),
        "rms_norm_eps": _f32(meta.arch_key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(meta.arch_key("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "torch_dtype": "float32",
        **_special_tokens(meta),
    }
    rope_dims = meta.arch_key("rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim:
        if mt != "phi3":
            raise InvalidModelError(
                f"GGUF file {meta.path} rotates {rope_dims} of {head_dim} head dimensions; "
                f"partial rotary is not supported for {mt}."
            )
        cfg["partial_rotary_factor"] = int(rope_dims) / head_dim
    window = meta.arch_key("attention.sliding_window")
    if window:
        cfg["sliding_window"] = int(window)
    if mt in ("llama", "mistral"):
        cfg["attention_bias"] = "blk.0.attn_q.bias" in tensors
        cfg["mlp_bias"] = False
    if mt.startswith("gemma"):
        cfg["hidden_activation"] = "gelu_pytorch_tanh"
    if mt == "gemma2":
        cfg["attn_logit_softcapping"] = meta.arch_key("attn_logit_softcapping")
        cfg["final_logit_softcapping"] = meta.arch_key("final_logit_softcapping")
    scaling = _rope_scaling(meta, cfg, small)
    if scaling:
        cfg["rope_scaling"] = scaling

    check_gguf_shapes(meta.path, meta.arch, cfg, tensors)
    return cfg


def _class_name(mt: str) -> str:
    return {
        "llama": "LlamaForCausalLM",
        "mistral": "MistralForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
        "phi3": "Phi3ForCausalLM",
        "gemma": "GemmaForCausalLM",
        "gemma2": "Gemma2ForCausalLM",
        "gemma3_text": "Gemma3ForCausalLM",
    }[mt]


def _special_tokens(meta: Metadata) -> dict[str, Any]:
    """bos/eos/pad ids; end-of-turn tokens (eot, eom) join eos, as in the models' generation configs."""
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = [
        int(t)
        for key in ("eos_token_id", "eot_token_id", "eom_token_id")
        if (t := meta.get(f"tokenizer.ggml.{key}")) is not None
    ]
    eos = list(dict.fromkeys(eos))
    pad = meta.get("tokenizer.ggml.padding_token_id")
    return {
        "bos_token_id": None if bos is None else int(bos),
        "eos_token_id": (eos[0] if len(eos) == 1 else eos) if eos else None,
        "pad_token_id": None if pad is None else int(pad),
    }


def _rope_scaling(meta: Metadata, cfg: dict[str, Any], small: dict[str, np.ndarray]) -> dict | None:
    kind = meta.arch_key("rope.scaling.type")
    if "rope_freqs.weight" in small:
        return _llama3_scaling(meta, cfg, small["rope_freqs.weight"])
    if "rope_factors_long.weight" in small:
        return _long_rope(meta, cfg, small)
    if kind in (None, "none"):
        return None
    factor = meta.arch_key("rope.scaling.factor")
    if kind == "linear" and factor:
        return {"rope_type": "linear", "factor": float(factor)}
    raise InvalidModelError(
        f"GGUF file {meta.path} uses rope scaling {kind!r} (factor {factor}); specport imports "
        "linear, Llama-3 and Phi-3 long-rope scaling only. Use the model's Hugging Face checkpoint."
    )


def _llama3_scaling(meta: Metadata, cfg: dict[str, Any], freqs: np.ndarray) -> dict:
    """Llama 3.x stores its rope scaling only as per-frequency divisors: recover the parameters.

    The divisors depend on (original context / low_freq_factor, original context /
    high_freq_factor, factor) only; Meta's published values (low 1, high 4, original 8192) are
    tried first and accepted only when they reproduce every divisor in the file.
    """
    factor = float(np.max(freqs))
    params = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    dim = int(cfg["head_dim"] * cfg.get("partial_rotary_factor", 1.0))
    want = _llama3_divisors(params, float(cfg["rope_theta"]), dim)
    if want.shape == freqs.shape and np.allclose(want, freqs, rtol=1e-5, atol=1e-6):
        return params
    raise InvalidModelError(
        f"GGUF file {meta.path} has rope frequency factors (rope_freqs) that do not match "
        "Llama 3's rope scaling; specport cannot represent them. Use the Hugging Face checkpoint."
    )


def _llama3_divisors(p: dict[str, Any], theta: float, dim: int) -> np.ndarray:
    """What llama.cpp's converter writes as `rope_freqs` for these parameters."""
    freqs = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    low_wavelen = p["original_max_position_embeddings"] / p["low_freq_factor"]
    high_wavelen = p["original_max_position_embeddings"] / p["high_freq_factor"]
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(p["factor"])
        else:
            smooth = (p["original_max_position_embeddings"] / wavelen - p["low_freq_factor"]) / (
                p["high_freq_factor"] - p["low_freq_factor"]
            )
            out.append(1 / ((1 - smooth) / p["factor"] + smooth))
    return np.asarray(out, dtype=np.float32)


def _long_rope(meta: Metadata, cfg: dict[str, Any], small: dict[str, np.ndarray]) -> dict:
    original = meta.arch_key("rope.scaling.original_context_length")
    if original is None:
        raise InvalidModelError(
            f"GGUF file {meta.path} has long-rope factors but no "
            f"'{meta.arch}.rope.scaling.original_context_length'; re-convert it."
        )
    cfg["original_max_position_embeddings"] = int(original)
    return {
        "rope_type": "longrope",
        "long_factor": [float(x) for x in small["rope_factors_long.weight"]],
        "short_factor": [float(x) for x in small["rope_factors_short.weight"]],
    }
