"""Tiny decoder models exported to the spine ONNX contract, for pass tests and benches.

Test helpers, not package code: the fusion bench (`benchmarks/bench_fusion.py`) imports them
from here too, run from a checkout. The graph follows the brief's
"concat" contract: inputs `input_ids`, `attention_mask`, `position_ids`,
`past_key_values.{i}.key/value`; outputs `logits`, `present.{i}.key/value`.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=256,
    initializer_range=0.2,
)


def _config(arch: str, **overrides: Any):
    import transformers as tf

    kw: dict[str, Any] = dict(TINY)
    cls: Any
    if arch == "llama":
        cls = tf.LlamaConfig
    elif arch == "qwen2":
        cls = tf.Qwen2Config
    elif arch == "qwen3":
        cls = tf.Qwen3Config
        kw["head_dim"] = 16
    elif arch == "mistral":
        cls = tf.MistralConfig
        kw["sliding_window"] = 4096
    elif arch == "phi3":
        cls = tf.Phi3Config
        kw["pad_token_id"] = 0
    elif arch == "gemma":
        cls = tf.GemmaConfig
        kw["head_dim"] = 16
    elif arch == "deepseek_v3":
        cls = tf.DeepseekV3Config
        kw.update(
            num_key_value_heads=4,
            moe_intermediate_size=32,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            kv_lora_rank=32,
            q_lora_rank=48,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            n_group=1,
            topk_group=1,
        )
    elif arch == "gpt2":
        cls = tf.GPT2Config
        kw = dict(
            n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=256, initializer_range=0.2
        )
    else:
        raise ValueError(f"unknown tiny arch {arch!r}")
    kw.update(overrides)
    return cls(**kw)


def tiny_model(arch: str, seed: int = 0, **overrides: Any):
    """A random-weight HF causal LM built from a tiny config (no download)."""
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    cfg = _config(arch, **overrides)
    extra = {"experts_implementation": "batched_mm"} if arch == "deepseek_v3" else {}
    model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", **extra).eval()
    # Norm weights start at ones; randomise them so a mis-wired norm fusion shows up.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def kv_dims(model) -> tuple[int, ...]:
    """(num_layers, kv_heads, key_dim[, value_dim]) of an HF model config (MLA: k != v dim)."""
    c = model.config
    n_layers = getattr(c, "num_hidden_layers", None) or c.n_layer
    heads = getattr(c, "num_attention_heads", None) or c.n_head
    kv = getattr(c, "num_key_value_heads", None) or heads
    if getattr(c, "v_head_dim", None) and getattr(c, "qk_nope_head_dim", None):
        return n_layers, kv, c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim
    hd = getattr(c, "head_dim", None) or (getattr(c, "hidden_size", None) or c.n_embd) // heads
    return n_layers, kv, hd


def _wrapper(model):
    """Like the exporter's FlatKVWrapper, but with a config-built cache: its sliding-window
    layers crop the past, the graph shape third-party exports have (fusion must handle it)."""
    import torch
    from transformers import DynamicCache

    class Wrapper(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, input_ids, attention_mask, position_ids, *past):
            cache = DynamicCache(config=self.m.config)
            for i in range(len(past) // 2):
                cache.update(past[2 * i], past[2 * i + 1], i)
            out = self.m(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=cache,
                use_cache=True,
            )
            res = [out.logits]
            for layer in out.past_key_values.layers:
                res += [layer.keys, layer.values]
            return tuple(res)

    return Wrapper(model)


def io_names(n_layers: int) -> tuple[list[str], list[str]]:
    from specport.exporter.wrapper import kv_input_names, kv_output_names

    ins = ["input_ids", "attention_mask", "position_ids", *kv_input_names(n_layers)]
    return ins, ["logits", *kv_output_names(n_layers)]


def export_tiny(model, path: str | os.PathLike, dynamo: bool = True) -> Path:
    """Export `model` to `path` with the spine I/O contract (weights external)."""
    import onnx
    import torch

    n_layers, kv, kd, *vd = kv_dims(model)
    b, s, p = 2, 3, 4
    past = [
        torch.randn(b, kv, p, kd if i % 2 == 0 else (vd or [kd])[0]) for i in range(2 * n_layers)
    ]
    args = (
        torch.randint(0, model.config.vocab_size, (b, s)),
        torch.ones(b, p + s, dtype=torch.int64),
        torch.arange(p, p + s).expand(b, s).contiguous(),
        *past,
    )
    ins, outs = io_names(n_layers)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            from specport.exporter.wrapper import dynamic_shapes

            ds = dynamic_shapes(n_layers)
            prog = torch.onnx.export(
                _wrapper(model),
                args,
                dynamic_shapes=ds,
                dynamo=True,
                opset_version=23,
                input_names=ins,
                output_names=outs,
            )
            assert prog is not None
            prog.save(str(path), external_data=True)
        else:
            axes: dict[str, dict[int, str]] = {
                "input_ids": {0: "batch", 1: "seq"},
                "attention_mask": {0: "batch", 1: "total"},
                "position_ids": {0: "batch", 1: "seq"},
                "logits": {0: "batch", 1: "seq"},
            }
            for name in ins[3:]:
                axes[name] = {0: "batch", 2: "past"}
            for name in outs[1:]:
                axes[name] = {0: "batch", 2: "total"}
            torch.onnx.export(
                _wrapper(model),
                args,
                str(path),
                dynamo=False,
                opset_version=17,
                input_names=ins,
                output_names=outs,
                dynamic_axes=axes,
            )
    onnx.checker.check_model(str(path))
    return path


def make_feeds(
    model_or_dims: Any,
    batch: int,
    seq: int,
    past: int,
    vocab: int,
    left_pad: list[int] | None = None,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """Random feeds for the spine contract; `left_pad[b]` zeros at the start of the mask."""
    dims = model_or_dims if isinstance(model_or_dims, tuple) else kv_dims(model_or_dims)
    n_layers, kv, kd = dims[:3]
    vd = dims[3] if len(dims) > 3 else kd
    rng = np.random.default_rng(seed)
    mask = np.ones((batch, past + seq), np.int64)
    pos = np.tile(np.arange(past, past + seq, dtype=np.int64), (batch, 1))
    for b, n in enumerate(left_pad or []):
        mask[b, :n] = 0
        pos[b] = np.maximum(np.arange(past, past + seq) - n, 0)
    feeds: dict[str, np.ndarray] = {
        "input_ids": rng.integers(0, vocab, (batch, seq), dtype=np.int64),
        "attention_mask": mask,
        "position_ids": pos,
    }
    for i in range(n_layers):
        for kvn, d in (("key", kd), ("value", vd)):
            feeds[f"past_key_values.{i}.{kvn}"] = rng.standard_normal(
                (batch, kv, past, d), dtype=np.float32
            )
    return feeds


def cached_export(arch: str, cache_dir: Path, dynamo: bool = True, **overrides: Any):
    """(model, path): export once per (arch, dynamo) into `cache_dir`."""
    model = tiny_model(arch, **overrides)
    tag = "dynamo" if dynamo else "ts"
    path = Path(cache_dir) / f"{arch}_{tag}" / "model.onnx"
    if not path.exists():
        export_tiny(model, path, dynamo=dynamo)
    return model, path


ExportFn = Callable[..., tuple[Any, Path]]


def cpu_session(model_or_path: Any, tmp: str | os.PathLike | None = None, threads: int = 0):
    """A bare CPU InferenceSession on a path or an onnx_ir model (saved to `tmp` first)."""
    import tempfile

    import onnxruntime as ort

    path = model_or_path
    if not isinstance(model_or_path, (str, Path)):
        tmp = Path(tmp or tempfile.mkdtemp(prefix="specport_"))
        from specport.passes.pipelines import save_model

        path = save_model(model_or_path, tmp / "model.onnx")
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if threads:
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        # no busy-waiting: on a shared machine spinning threads distort timings
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
