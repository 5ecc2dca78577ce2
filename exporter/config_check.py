"""Does config.json describe the weights beside it? Checked before any weight is loaded.

Why: when a config field is missing or wrong (say `hidden_size` removed), transformers fills in
its default and loading fails on a shape mismatch, which reads like a corrupt download; users
then re-download gigabytes for nothing. The weight files' own headers (safetensors) hold every
tensor's shape, so the model the config describes (built on the meta device: no memory) is
compared with them, and the config field that disagrees is named with the value the weights
imply. Weight files are blamed only when their own headers or sizes are wrong
(`checkpoint._read_header`).
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specport.core.errors import InvalidModelError
from specport.exporter.checkpoint import Checkpoint

logger = logging.getLogger(__name__)

# Which config fields a tensor's name makes likely, per axis (first match wins).
AFFINITY: list[tuple[str, tuple[tuple[str, ...], ...]]] = [
    (r"embed|wte|lm_head|output\.weight", (("vocab_size",), ("hidden_size", "n_embd", "dim"))),
    (r"wpe|position", (("max_position_embeddings", "n_positions"), ("hidden_size", "n_embd"))),
    (r"k_proj|v_proj", (("num_key_value_heads", "head_dim"), ("hidden_size", "n_embd"))),
    (r"gate_proj|up_proj|c_fc|fc1|w1|w3", (("intermediate_size", "n_inner"), ("hidden_size",))),
    (r"down_proj|fc2|w2", (("hidden_size", "n_embd"), ("intermediate_size", "n_inner"))),
    (r"", (("hidden_size", "n_embd", "num_attention_heads", "head_dim"),) * 2),
]
LAYER_INDEX = re.compile(r"\.(?:layers|h|blocks|layer)\.(\d+)\.")
IGNORED_FIELDS = re.compile(r"token_id|dtype|version|seed|chunk|max_length|min_length|num_beams")


@dataclass(frozen=True)
class Mismatch:
    tensor: str
    expected: tuple[int, ...]
    actual: tuple[int, ...]


def _int_fields(config: Any) -> dict[str, int]:
    fields = {}
    for key, value in config.to_dict().items():
        usable = isinstance(value, int) and not isinstance(value, bool) and value > 1
        if usable and not IGNORED_FIELDS.search(key):
            fields[key] = value
    for alias, real in getattr(config, "attribute_map", {}).items():
        if real in fields:
            fields.setdefault(alias, fields[real])
    return fields


def _expected_shapes(config: Any, load_kwargs: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """Parameter name -> shape of the model `config` describes (meta device), and its prefix."""
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=True):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **load_kwargs)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}
    return shapes, getattr(model, "base_model_prefix", "") or ""


def _lookup(name: str, prefix: str, tensors: dict[str, tuple[int, ...]]) -> str | None:
    if name in tensors:
        return name
    if prefix and name.startswith(prefix + ".") and name[len(prefix) + 1 :] in tensors:
        return name[len(prefix) + 1 :]
    if prefix and f"{prefix}.{name}" in tensors:
        return f"{prefix}.{name}"
    return None


def _candidates(m: Mismatch, fields: dict[str, int]) -> list[tuple[str, int]]:
    """(field, value the weights imply) that would explain `m`, likeliest first."""
    affinity = next(a for pattern, a in AFFINITY if re.search(pattern, m.tensor))
    found: list[tuple[int, str, int]] = []  # (rank, field, implied)
    for axis, (want, have) in enumerate(zip(m.expected, m.actual)):
        if want == have:
            continue
        liked = affinity[min(axis, len(affinity) - 1)]
        for field, value in fields.items():
            rank = liked.index(field) if field in liked else len(liked)
            if value == want:
                found.append((rank, field, have))
                continue
            for other, factor in fields.items():  # heads x head_dim and the like
                if other != field and value * factor == want and have % factor == 0:
                    found.append((rank + 1, field, have // factor))
    found.sort(key=lambda t: t[0])
    return [(f, v) for _, f, v in found]


def _confirmed(tensor: str, shape: tuple[int, ...], fields: dict[str, int]) -> set[str]:
    """Fields that `tensor`'s matching shape shows directly (e.g. the embedding: vocab, hidden)."""
    affinity = next(a for pattern, a in AFFINITY if re.search(pattern, tensor))
    out = set()
    for axis, dim in enumerate(shape):
        for field in affinity[min(axis, len(affinity) - 1)]:
            if fields.get(field) == dim:
                out.add(field)
    return out


def _layers(tensors: dict[str, tuple[int, ...]]) -> int | None:
    indices = {int(m.group(1)) for k in tensors if (m := LAYER_INDEX.search(k))}
    return max(indices) + 1 if indices else None


def check_config_against_weights(
    model_dir: Path, config: Any, layers_attr: str, load_kwargs: dict[str, Any]
) -> None:
    """Raise InvalidModelError naming the config field that disagrees with the safetensors
    weights in `model_dir`; silent when they agree or when there is nothing cheap to read."""

    checkpoint = Checkpoint.open(model_dir)  # a truncated file is blamed here, rightly
    if checkpoint is None:
        return
    tensors = {k: info.shape for k, info in checkpoint.tensors.items()}
    files = {k: info.file.name for k, info in checkpoint.tensors.items()}
    cfg_path = model_dir / "config.json"
    raw = _raw_keys(cfg_path)
    fields = _int_fields(config)

    def described(field: str) -> str:
        value = fields.get(field, getattr(config, field, "?"))
        real = getattr(config, "attribute_map", {}).get(field, field)
        if field in raw or real in raw:
            return f"{cfg_path} has {field} = {value}"
        return f"{cfg_path} has no {field}, so transformers used its default {value}"

    stored = _layers(tensors)
    declared = int(getattr(config, layers_attr, 0) or 0)
    # DeepSeek-V3-style checkpoints keep their MTP module as the layers after the decoder's
    mtp = int(getattr(config, "num_nextn_predict_layers", 0) or 0)
    if stored is not None and declared and stored not in (declared, declared + mtp):
        raise InvalidModelError(
            f"{described(layers_attr)}, but the weights hold {stored} layers; set "
            f'"{layers_attr}": {stored} (the weight files are fine).'
        )
    try:
        expected, prefix = _expected_shapes(config, load_kwargs)
    except Exception as e:  # noqa: BLE001 - a config transformers cannot build: its own error
        logger.info("config check skipped: %s", e)
        return
    mismatches, confirmed = [], set()
    for name, shape in expected.items():
        key = _lookup(name, prefix, tensors)
        if key is not None and tensors[key] != shape:
            mismatches.append(Mismatch(key, shape, tensors[key]))
        elif key is not None:  # a field this tensor's shape shows to be right is not the culprit
            confirmed |= _confirmed(key, shape, fields)
    if not mismatches:
        return
    # the (field, implied value) that explains the most mismatched tensors, then the likeliest
    covered: Counter[tuple[str, int]] = Counter()
    rank: Counter[tuple[str, int]] = Counter()
    for m in mismatches:
        cands = list(dict.fromkeys(_candidates(m, fields)))
        cands = [c for c in cands if c[0] not in confirmed] or cands
        for i, cand in enumerate(cands):
            covered[cand] += 1
            rank[cand] += i
    votes = sorted(covered, key=lambda c: (-covered[c], rank[c]))
    first = mismatches[0]
    where = f"{first.tensor} is {list(first.actual)} in {files[first.tensor]}"
    if not votes:
        raise InvalidModelError(
            f"{cfg_path} does not describe the weights: {where}, the config needs "
            f"{list(first.expected)}; fix config.json (the weight files are fine)."
        )
    field, implied = votes[0]
    example = next(m for m in mismatches if (field, implied) in _candidates(m, fields))
    raise InvalidModelError(
        f"{described(field)}, but the weights imply {field} = {implied} "
        f"({example.tensor} is {list(example.actual)} in {files[example.tensor]}, the config "
        f'needs {list(example.expected)}); set "{field}": {implied} (the weight files are fine).'
    )


def _raw_keys(cfg_path: Path) -> set[str]:
    import json

    try:
        raw = json.loads(cfg_path.read_text())
    except (OSError, ValueError):
        return set()
    keys = set(raw) if isinstance(raw, dict) else set()
    for sub in ("text_config",):
        if isinstance(raw, dict) and isinstance(raw.get(sub), dict):
            keys |= set(raw[sub])
    return keys


# GGUF: (metadata key, its config value, tensor, ggml axis, divisor key) — ggml shapes list the
# row length first: token_embd.weight is [hidden, vocab], blk.N.attn_k.weight [hidden, kv * Dh].
GGUF_SHAPES = [
    ("embedding_length", "hidden_size", "token_embd.weight", 0, None),
    ("vocab_size", "vocab_size", "token_embd.weight", 1, None),
    ("feed_forward_length", "intermediate_size", "blk.0.ffn_up.weight", 1, None),
    ("attention.head_count", "num_attention_heads", "blk.0.attn_q.weight", 1, "head_dim"),
    ("attention.head_count_kv", "num_key_value_heads", "blk.0.attn_k.weight", 1, "head_dim"),
]
GGUF_BLOCK = re.compile(r"^blk\.(\d+)\.")
# Architectures whose GGUF stores gate and up projections as one `ffn_up` tensor (twice as tall).
GGUF_FUSED_GATE_UP = {"phi3"}


def check_gguf_shapes(path: str, arch: str, cfg: dict[str, Any], tensors: dict[str, Any]) -> None:
    """Raise when a GGUF file's metadata disagrees with its own tensor shapes, naming the key and
    the value the tensors imply: then the file itself is inconsistent (its converter wrote a
    wrong key), and re-converting it is the fix."""
    blocks = {int(m.group(1)) for name in tensors if (m := GGUF_BLOCK.match(name))}
    if blocks and max(blocks) + 1 != cfg["num_hidden_layers"]:
        raise InvalidModelError(
            f"GGUF file {path}: metadata {arch}.block_count is {cfg['num_hidden_layers']}, but "
            f"its tensors hold {max(blocks) + 1} blocks; the file's metadata disagrees with its "
            "weights: re-convert it (llama.cpp's convert_hf_to_gguf.py)."
        )
    for key, field, tensor, axis, per in GGUF_SHAPES:
        t = tensors.get(tensor)
        if t is None or field not in cfg:
            continue
        shape = [int(d) for d in t.shape]
        if axis >= len(shape):
            continue
        have = shape[axis] // (int(cfg[per]) if per else 1)
        if field == "intermediate_size" and arch in GGUF_FUSED_GATE_UP:
            have //= 2
        if have != int(cfg[field]):
            key_name = f"{arch}.{key}" if key != "vocab_size" else "tokenizer.ggml.tokens (count)"
            raise InvalidModelError(
                f"GGUF file {path}: metadata {key_name} is {cfg[field]}, but tensor {tensor} is "
                f"{shape} (ggml order), which implies {have}; the file's metadata disagrees "
                "with its weights: re-convert it (llama.cpp's convert_hf_to_gguf.py)."
            )
