"""Stand-in exporter for the quantization tests: a flat-KV wrapper around a HF Llama, exported
with dynamo into a minimal artifact directory (manifest + model.onnx + data + tokenizer).

Used until/unless `specport.exporter.export.export_model` is available; the graph follows the
spine contract (input_ids, attention_mask, position_ids, past_key_values.{i}.key/value ->
logits, present.{i}.key/value).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from specport.artifact import KVLayout, Manifest, write_manifest


class _Flat(torch.nn.Module):
    def __init__(self, model: LlamaForCausalLM) -> None:
        super().__init__()
        self.model = model
        self.n = model.config.num_hidden_layers

    def forward(self, input_ids, attention_mask, position_ids, *past):
        cache = DynamicCache(config=self.model.config)
        for i in range(self.n):
            cache.update(past[2 * i], past[2 * i + 1], i)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
        )
        flat = []
        for i in range(self.n):
            layer = out.past_key_values.layers[i]
            flat += [layer.keys, layer.values]
        return (out.logits, *flat)


def tiny_config(
    layers: int = 2, hidden: int = 64, inter: int = 128, vocab: int = 256
) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        vocab_size=vocab,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )


def export_artifact(model: LlamaForCausalLM, out: Path, tokenizer_dir: Path | None = None) -> Path:
    """Export `model` into artifact directory `out` (created); returns `out`."""
    model = model.eval()
    cfg = model.config
    n = cfg.num_hidden_layers
    hkv = cfg.num_key_value_heads
    dh = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    b, s, p = 2, 3, 4
    ids = torch.randint(0, cfg.vocab_size, (b, s))
    mask = torch.ones(b, p + s, dtype=torch.int64)
    pos = torch.arange(p, p + s).unsqueeze(0).expand(b, s).contiguous()
    past = [torch.randn(b, hkv, p, dh) for _ in range(2 * n)]
    names_in = ["input_ids", "attention_mask", "position_ids"]
    kv_in, kv_out = [], []
    for i in range(n):
        kv_in.append([f"past_key_values.{i}.key", f"past_key_values.{i}.value"])
        kv_out.append([f"present.{i}.key", f"present.{i}.value"])
    B, S, P = torch.export.Dim("B"), torch.export.Dim("S"), torch.export.Dim("P")
    T = torch.export.Dim.AUTO
    dyn = {
        "input_ids": {0: B, 1: S},
        "attention_mask": {0: B, 1: T},
        "position_ids": {0: B, 1: S},
        "past": tuple({0: B, 2: P} for _ in range(2 * n)),
    }
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.onnx.export(
        _Flat(model),
        (ids, mask, pos, *past),
        str(out / "model.onnx"),
        input_names=names_in + [x for pair in kv_in for x in pair],
        output_names=["logits"] + [x for pair in kv_out for x in pair],
        dynamic_shapes=dyn,
        dynamo=True,
        opset_version=23,
        external_data=True,
    )
    if tokenizer_dir is not None:
        for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"):
            if (Path(tokenizer_dir) / f).exists():
                shutil.copy(Path(tokenizer_dir) / f, out / f)
    manifest = Manifest(
        architecture="llama",
        config={
            "num_layers": n,
            "vocab_size": cfg.vocab_size,
            "context_length": cfg.max_position_embeddings,
            "bos_token_id": cfg.bos_token_id,
            "eos_token_ids": [cfg.eos_token_id],
            "hidden_size": cfg.hidden_size,
        },
        io={"inputs": [], "outputs": []},
        kv=KVLayout(
            layout="concat",
            inputs=kv_in,
            outputs=kv_out,
            num_heads=[hkv] * n,
            key_dim=[dh] * n,
            value_dim=[dh] * n,
        ),
        source={"kind": "test"},
    )
    write_manifest(out, manifest)
    return out
