"""Write a random-weight Hugging Face checkpoint of a real model's shape, tensor by tensor.

For the bounded-memory measurements (export and quantization at real sizes) without
downloading weights: the model is built on the meta device from a config (no memory), then each
parameter is drawn and appended to a safetensors shard, so writing a 16 GB bf16 Llama-3.1-8B
shape needs one tensor of memory. Shapes come from the real configs (hidden, layers, heads,
vocab); weights are N(0, 0.02) like transformers' init, norms 1.

    python scripts/random_checkpoint.py qwen2.5-0.5b out/qwen05
    python scripts/random_checkpoint.py llama-3.2-1b out/llama1b
    python scripts/random_checkpoint.py llama-3.1-8b out/llama8b --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import struct
from pathlib import Path
from typing import Any

import torch

CONFIGS: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "bos_token_id": 151643,
        "eos_token_id": 151643,
    },
    "llama-3.2-1b": {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    },
    "llama-3.1-8b": {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    },
}

DTYPES = {"float32": ("F32", torch.float32), "bfloat16": ("BF16", torch.bfloat16)}


def _shapes(config: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return [(n, tuple(p.shape)) for n, p in model.state_dict().items()]


def _write_shard(
    path: Path, items: list[tuple[str, tuple[int, ...]]], dtype: str, seed: int, tile: bool = False
) -> None:
    code, tdtype = DTYPES[dtype]
    size = torch.tensor([], dtype=tdtype).element_size()
    header: dict[str, Any] = {}
    offset = 0
    for name, shape in items:
        n = 1
        for d in shape:
            n *= d
        header[name] = {
            "dtype": code,
            "shape": list(shape),
            "data_offsets": [offset, offset + n * size],
        }
        offset += n * size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    g = torch.Generator().manual_seed(seed)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, shape in items:
            if "norm" in name and len(shape) == 1:
                t = torch.ones(shape, dtype=tdtype)
            elif len(shape) == 1:
                t = torch.zeros(shape, dtype=tdtype)  # biases
            elif tile:  # a random block repeated: same bytes and layout, seconds not minutes
                n = int(torch.Size(shape).numel())
                block = (torch.randn(min(n, 1 << 20), generator=g) * 0.02).to(tdtype)
                t = block.repeat(-(-n // block.numel()))[:n].reshape(shape)
            else:
                t = (torch.randn(shape, generator=g) * 0.02).to(tdtype)
            f.write(t.contiguous().view(torch.uint8).numpy().tobytes())
            del t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("shape", choices=sorted(CONFIGS))
    ap.add_argument("out")
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--shard-gb", type=float, default=4.0)
    ap.add_argument("--layers", type=int, default=None, help="keep only the first N layers")
    ap.add_argument(
        "--tile",
        action="store_true",
        help="repeat a 1M-value random block in each tensor (fast; for memory/time runs)",
    )
    args = ap.parse_args()
    config = dict(CONFIGS[args.shape])
    if args.layers:
        config["num_hidden_layers"] = args.layers
    config["torch_dtype"] = args.dtype
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    items = _shapes(config)
    if config.get("tie_word_embeddings"):
        items = [(n, s) for n, s in items if n != "lm_head.weight"]
    size = DTYPES[args.dtype][1].itemsize
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    used = 0
    for name, shape in items:
        n = size
        for d in shape:
            n *= d
        if shards[-1] and used + n > args.shard_gb * 1e9:
            shards.append([])
            used = 0
        shards[-1].append((name, shape))
        used += n
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        fname = (
            "model.safetensors"
            if len(shards) == 1
            else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        )
        _write_shard(out / fname, shard, args.dtype, seed=i, tile=args.tile)
        weight_map.update({n: fname for n, _ in shard})
        print(f"wrote {fname} ({len(shard)} tensors)", flush=True)
    if len(shards) > 1:
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1)
        )
    (out / "config.json").write_text(json.dumps(config, indent=1))
    total = sum(size * int(torch.Size(s).numel()) for _, s in items)
    print(f"{args.shape}: {total / 1e9:.2f} GB of {args.dtype} weights in {out}")


if __name__ == "__main__":
    main()
