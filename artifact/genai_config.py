"""genai_config.json: what `onnxruntime_genai.Model(artifact)` reads to run an artifact as is.

The schema is onnxruntime-genai 0.18's (models/builders/base.py: make_genai_config). Its parser
rejects unknown keys, so what genai cannot run, and why, is recorded in the manifest's
`interop.runtimes` and the model card, not in this file. The support check is a pure function of
the manifest so `specport inspect` can answer for artifacts written before this file existed.
"""

from __future__ import annotations

import logging
from typing import Any

from specport.artifact.genai_graph import (
    DERIVED_INPUTS,
    GENAI_FEEDS,
    GENAI_MODEL_NAME,
    needs_genai_graph,
)

logger = logging.getLogger(__name__)

GENAI_CONFIG_NAME = "genai_config.json"
# Decoder-only `type`s genai 0.18 runs as its generic decoder; anything else (gpt2, deepseek_v3,
# whose genai types expect a different graph contract) is declared as the generic "decoder".
GENAI_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "phi3", "gemma"})
CHECKED_TARGETS = frozenset({"cpu", "neutral"})  # run in CI on genai's CPU provider
_PAST, _PRESENT = "past_key_values.%d.", "present.%d."


def _names(manifest: Any, side: str) -> list[str]:
    return [str(v["name"]) for v in manifest.io.get(side, [])]


def _expected_kv_names(manifest: Any) -> bool:
    kv = manifest.kv
    n = len(kv.inputs)
    return n > 0 and (
        [list(p) for p in kv.inputs]
        == [[f"past_key_values.{i}.key", f"past_key_values.{i}.value"] for i in range(n)]
        and [list(p) for p in kv.outputs]
        == [[f"present.{i}.key", f"present.{i}.value"] for i in range(n)]
    )


def genai_support(manifest: Any) -> dict[str, Any]:
    """Whether genai runs this artifact: {"status": yes|no|untested, "decoder", "reason"/"notes"}."""
    kv = manifest.kv
    inputs, outputs = _names(manifest, "inputs"), _names(manifest, "outputs")
    kv_names = {n for pair in kv.inputs for n in pair}

    def no(reason: str) -> dict[str, Any]:
        return {"status": "no", "reason": reason}

    if not inputs or "input_ids" not in inputs or "logits" not in outputs:
        return no("the graph has no input_ids -> logits signature")
    if not _expected_kv_names(manifest):
        return no("its KV tensors are not named past_key_values.N.key/value, present.N.key/value")
    if len(set(kv.num_heads)) != 1 or len(set(kv.key_dim) | set(kv.value_dim)) != 1:
        return no(
            "genai sizes every layer's cache from one head count and one head size; this model "
            f"has KV heads {sorted(set(kv.num_heads))}, key/value head dims "
            f"{sorted(set(kv.key_dim) | set(kv.value_dim))}"
        )
    unknown = [n for n in inputs if n not in kv_names and n not in (*GENAI_FEEDS, *DERIVED_INPUTS)]
    if unknown:
        return no(f"the graph takes input(s) {unknown} that genai does not feed")
    decoder = GENAI_MODEL_NAME if needs_genai_graph(inputs, outputs) else manifest.model_file
    notes = []
    if decoder == GENAI_MODEL_NAME:
        notes.append(
            f"runs {GENAI_MODEL_NAME}, a weightless graph sharing the weights that derives "
            f"{[n for n in inputs if n in DERIVED_INPUTS] or 'nothing'} in graph and drops "
            "outputs genai does not read"
        )
    if "tree_mask" in inputs:
        notes.append("plain causal decoding only (genai does not verify token trees)")
    if manifest.mtp:
        notes.append("plain decoding only: the MTP branch is left out (specport runs it)")
    if kv.dtype != "float32":
        notes.append(f"{kv.dtype} KV cache: genai allocates it from the graph's input type")
    if kv.layout == "shared":
        notes.append(f"one preallocated cache (past_present_share_buffer), at most {kv.max_length}")
    status = "yes" if manifest.target in CHECKED_TARGETS else "untested"
    if status == "untested":
        notes.append(f"target {manifest.target!r} is not run with genai in specport's tests")
    return {"status": status, "decoder": decoder, "notes": notes}


def genai_config(
    manifest: Any, decoder: str, generation: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The genai_config.json dict for an artifact genai supports (see `genai_support`)."""
    c, kv = manifest.config, manifest.kv
    generation = generation or {}
    shared = kv.layout == "shared"
    context = int(kv.max_length if shared and kv.max_length else c["context_length"])
    eos = [int(t) for t in c.get("eos_token_ids") or []]
    pad = c.get("pad_token_id")
    inputs: dict[str, str] = {"input_ids": "input_ids", "attention_mask": "attention_mask"}
    if "position_ids" in _names(manifest, "inputs"):
        inputs["position_ids"] = "position_ids"
    inputs["past_key_names"] = _PAST + "key"
    inputs["past_value_names"] = _PAST + "value"
    session: dict[str, Any] = {"log_id": "onnxruntime-genai", "provider_options": []}
    if manifest.target == "cuda":
        session["provider_options"].append({"cuda": {}})
    # onnxruntime session config entries (e.g. the QDQ -> MatMulNBits accuracy level) are plain
    # string keys of genai's session_options, as in genai's builder.
    for key, value in ((manifest.quant or {}).get("ort_session_config") or {}).items():
        session[str(key)] = str(value)
    top_k = generation.get("top_k")
    top_p = generation.get("top_p")
    return {
        "model": {
            "bos_token_id": int(c["bos_token_id"]) if c.get("bos_token_id") is not None else 0,
            "context_length": context,
            "decoder": {
                "session_options": session,
                "filename": decoder,
                "head_size": int(kv.key_dim[0]),
                "hidden_size": int(c["hidden_size"]),
                "inputs": inputs,
                "outputs": {
                    "logits": "logits",
                    "present_key_names": _PRESENT + "key",
                    "present_value_names": _PRESENT + "value",
                },
                "num_attention_heads": int(c["num_heads"]),
                "num_hidden_layers": len(kv.inputs),
                "num_key_value_heads": int(kv.num_heads[0]),
            },
            "eos_token_id": eos if len(eos) != 1 else eos[0],
            "pad_token_id": int(pad) if pad is not None else (eos[0] if eos else 0),
            "type": c["model_type"] if c["model_type"] in GENAI_TYPES else "decoder",
            "vocab_size": int(c["vocab_size"]),
        },
        "search": {
            "diversity_penalty": 0.0,
            "do_sample": bool(generation.get("do_sample", False)),
            "early_stopping": True,
            "length_penalty": 1.0,
            "max_length": context,
            "min_length": 0,
            "no_repeat_ngram_size": 0,
            "num_beams": 1,
            "num_return_sequences": 1,
            "past_present_share_buffer": shared,
            "repetition_penalty": float(generation.get("repetition_penalty") or 1.0),
            "temperature": float(generation.get("temperature") or 1.0),
            "top_k": int(top_k) if top_k is not None else 50,
            "top_p": float(top_p) if top_p is not None else 1.0,
        },
    }
