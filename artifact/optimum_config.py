"""config.json for Optimum's `ORTModelForCausalLM.from_pretrained(artifact)`, and whether it runs.

Optimum (optimum-onnx 0.1.0) loads `model.onnx` from the directory, reads the transformers
config, feeds `input_ids`, `attention_mask`, `position_ids` and the `past_key_values.N.key/value`
it finds among the graph inputs, and reads `logits` and `present.N.*`. For the first step it
builds empty pasts whose head count and head size it takes from the config, by model type
(optimum/onnxruntime/modeling_decoder.py, ORTModelForCausalLM.__init__); `optimum_support`
reproduces that rule so an artifact whose cache it would size wrongly is reported, not shipped
as working.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

HF_CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
OPTIMUM_FEEDS = ("input_ids", "attention_mask", "position_ids")
# optimum-onnx 0.1.0: model types whose empty past uses config.num_key_value_heads (others use
# num_attention_heads) and whose head size is config.head_dim (others: hidden / heads).
_KV_HEADS_TYPES = frozenset(
    [
        "arcee",
        "deepseek_v3",
        "cohere",
        "gemma",
        "gemma3_text",
        "glm",
        "granite",
        "gpt_oss",
        "helium",
        "mistral",
        "llama",
        "nemotron",
        "qwen2",
        "qwen3",
        "qwen3_moe",
        "smollm3",
        "stablelm",
    ]
)
_HEAD_DIM_TYPES = frozenset({"gemma", "gemma3_text", "gpt_oss", "nemotron"})
_ALIASES = {
    "n_embd": "hidden_size",
    "n_head": "num_attention_heads",
    "n_layer": "num_hidden_layers",
}


def _get(cfg: dict[str, Any], key: str) -> Any:
    if key in cfg:
        return cfg[key]
    return next((cfg[k] for k, v in _ALIASES.items() if v == key and k in cfg), None)


def optimum_cache_shape(cfg: dict[str, Any]) -> tuple[int, int, int] | None:
    """(kv heads, key head size, value head size) Optimum allocates for the first step."""
    model_type = cfg.get("model_type")
    heads, hidden = _get(cfg, "num_attention_heads"), _get(cfg, "hidden_size")
    if not heads or not hidden:
        return None
    kv_heads = cfg.get("num_key_value_heads") if model_type in _KV_HEADS_TYPES else heads
    if model_type == "deepseek_v3":
        k = int(cfg["qk_rope_head_dim"]) + int(cfg["qk_nope_head_dim"])
        return int(kv_heads or heads), k, int(cfg["v_head_dim"])
    dim = int(cfg["head_dim"]) if model_type in _HEAD_DIM_TYPES else int(hidden) // int(heads)
    return int(kv_heads or heads), dim, dim


def optimum_support(manifest: Any, cfg: dict[str, Any] | None) -> dict[str, Any]:
    """Whether Optimum runs this artifact: {"status": yes|no, "reason"?}."""
    kv = manifest.kv

    def no(reason: str) -> dict[str, Any]:
        return {"status": "no", "reason": reason}

    if kv.layout != "concat":
        return no(f"the {kv.layout} KV layout; Optimum grows the cache by concatenation (concat)")
    if kv.dtype != "float32":
        return no(f"the {kv.dtype} KV cache; Optimum feeds a float cache")
    kv_names = {n for pair in kv.inputs for n in pair}
    inputs = [str(v["name"]) for v in manifest.io.get("inputs", [])]
    unknown = [n for n in inputs if n not in kv_names and n not in OPTIMUM_FEEDS]
    if unknown:
        return no(f"the graph takes input(s) {unknown} that Optimum does not feed")
    if any(not n.startswith("past_key_values.") for n in kv_names):
        return no("its past KV inputs are not named past_key_values.N.key/value")
    if cfg is None:
        return no(f"no {HF_CONFIG_NAME} to read the model type from")
    shape = optimum_cache_shape(cfg)
    ours = {(h, k, v) for h, k, v in zip(kv.num_heads, kv.key_dim, kv.value_dim)}
    if shape is None or ours != {shape}:
        return no(
            f"Optimum sizes the first empty past of a {cfg.get('model_type')!r} model as "
            f"(heads, key dim, value dim) {shape}; this model's cache is {sorted(ours)}"
        )
    return {"status": "yes"}


def save_source_config(config: Any, directory: Path) -> None:
    """Write the source model's transformers config (as loaded, layers kept) into the artifact."""
    data = config.to_dict()
    (directory / HF_CONFIG_NAME).write_text(json.dumps(data, indent=2, default=str) + "\n")


def hf_config(existing: dict[str, Any] | None, manifest: Any) -> dict[str, Any]:
    """config.json describing the artifact: the source's config, or one built from the manifest.

    Kept consistent with the graph (layer count, fp32 weights, cache on); transformers 4.x reads
    `torch_dtype` and a top-level `rope_theta`, which transformers 5 writes elsewhere.
    """
    c = manifest.config
    cfg = dict(existing) if existing else _from_manifest(manifest)
    layers_attr = "n_layer" if "n_layer" in cfg else "num_hidden_layers"
    cfg[layers_attr] = len(manifest.kv.inputs) or c.get("num_layers")
    cfg["use_cache"] = True
    cfg.pop("quantization_config", None)  # the weights are in the graph, not in this config
    cfg.setdefault("torch_dtype", "float32")
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" not in cfg and isinstance(rope, dict) and rope.get("rope_theta"):
        cfg["rope_theta"] = rope["rope_theta"]
    return cfg


def _from_manifest(manifest: Any) -> dict[str, Any]:
    c = manifest.config
    model_type = str(c.get("model_type"))
    eos = c.get("eos_token_ids") or []
    cfg: dict[str, Any] = {
        "architectures": [_ARCH_CLASSES.get(model_type, "LlamaForCausalLM")],
        "model_type": model_type,
        "hidden_size": c.get("hidden_size"),
        "num_attention_heads": c.get("num_heads"),
        "num_key_value_heads": c.get("num_kv_heads"),
        "head_dim": c.get("head_dim"),
        "num_hidden_layers": c.get("num_layers"),
        "vocab_size": c.get("vocab_size"),
        "max_position_embeddings": c.get("context_length"),
        "bos_token_id": c.get("bos_token_id"),
        "eos_token_id": eos[0] if len(eos) == 1 else eos,
        "pad_token_id": c.get("pad_token_id"),
        "tie_word_embeddings": c.get("tie_word_embeddings", False),
    }
    if c.get("rope_theta"):
        cfg["rope_theta"] = c["rope_theta"]
    return cfg


def tokenizer_config_compat(data: dict[str, Any]) -> dict[str, Any] | None:
    """tokenizer_config.json that transformers 4.x (Optimum's) and 5.x both read, or None if it is.

    transformers 5 writes the extra special tokens as a list under `extra_special_tokens`, where
    4.x expects a dict there and crashes on the list; both read the list as
    `additional_special_tokens`, so it moves there (same tokens, same ids). Its
    `TokenizersBackend` class is `PreTrainedTokenizerFast` in both (5.x keeps that name as alias).
    """
    extra = data.get("extra_special_tokens")
    renamed = data.get("tokenizer_class") == "TokenizersBackend"
    if not isinstance(extra, list) and not renamed:
        return None
    out = {k: v for k, v in data.items() if k != "extra_special_tokens" or not isinstance(v, list)}
    if isinstance(extra, list):
        merged = list(out.get("additional_special_tokens") or [])
        out["additional_special_tokens"] = merged + [t for t in extra if t not in merged]
    if renamed:  # transformers 5's name for the class 4.x calls PreTrainedTokenizerFast
        out["tokenizer_class"] = "PreTrainedTokenizerFast"
    return out


def generation_config(manifest: Any) -> dict[str, Any]:
    """A greedy generation_config.json from the manifest's token ids (when the source had none)."""
    c = manifest.config
    eos = c.get("eos_token_ids") or []
    return {
        "bos_token_id": c.get("bos_token_id"),
        "eos_token_id": eos[0] if len(eos) == 1 else eos,
        "pad_token_id": c.get("pad_token_id"),
        "do_sample": False,
    }


_ARCH_CLASSES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "gpt2": "GPT2LMHeadModel",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}
