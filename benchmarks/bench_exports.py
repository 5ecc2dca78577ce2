"""specport vs onnxruntime's and onnxscript's optimizers on graphs other tools exported.

    python -m benchmarks.bench_fusion --inputs exports [--repeat 20] [--json]

Inputs: the export fixtures under tests/passes/fixtures (Optimum's Llama / Qwen2 / Phi-3 /
GPT-2, TorchScript GPT-2 in onnxruntime's gpt2_helper layout with and without past; 2 layers,
hidden 32), plus a bench-size TorchScript GPT-2 with stacked past exported here (8 layers,
hidden 512, biases and LayerNorms random) and the dynamo Llama of bench_fusion. Each input goes through
  specport   optimize_model(target="cpu")
  onnxscript onnxscript.rewriter.ort_fusions.optimize_for_ort
  ort        onnxruntime.transformers.optimizer.optimize_model(model_type="gpt2", num_heads,
             hidden_size given)
and each result is timed in one interleaved loop (decode: B=1, S=1, past 64; prefill: B=1,
S=64; CPU, 1 thread; an input without a cache decodes one token with no past). Reported per input and tool: fused attention layers (Attention /
GroupQueryAttention / MultiHeadAttention nodes, an If wrapping one counted once), Softmax
nodes left, skip-norms (those with the bias folded in), FastGelu/BiasGelu (bare Gelu left),
main-graph nodes, median ms; a tool that fails on an input is reported with its
error.
"""

from __future__ import annotations

import logging
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.timing import BENCH_CONFIG, bound_run, export_llama30m, interleaved

logger = logging.getLogger(__name__)

ATTENTION_OPS = {"Attention", "GroupQueryAttention", "MultiHeadAttention", "PackedAttention"}
TOOLS = ("input", "specport", "onnxscript", "ort")


def fixtures_dir() -> Path:
    return Path(__file__).resolve().parents[1] / "tests" / "passes" / "fixtures"


def fused_attention(proto: Any) -> int:
    """Attention-like nodes of the main graph; an If holding one in a branch counts once."""
    n = 0
    for node in proto.graph.node:
        if node.op_type in ATTENTION_OPS:
            n += 1
        elif node.op_type == "If":
            branches = [a.g for a in node.attribute if a.name in ("then_branch", "else_branch")]
            if any(x.op_type in ATTENTION_OPS for g in branches for x in g.node):
                n += 1
    return n


def fused_other(proto: Any) -> dict[str, int]:
    """Main-graph counts of the other fused kernels: skip-norms (and how many carry a bias),
    bias + GELU kernels, and GELU nodes with the bias Add still outside."""
    nodes = list(proto.graph.node)
    skip = [n for n in nodes if n.op_type.startswith("Skip") and "Normalization" in n.op_type]
    slot = {"SkipLayerNormalization": 4, "SkipSimplifiedLayerNormalization": 3}
    biased = [
        n for n in skip if len(n.input) > slot.get(n.op_type, 99) and n.input[slot[n.op_type]]
    ]
    return {
        "skip_norm": len(skip),
        "skip_norm_bias": len(biased),
        "bias_gelu": sum(n.op_type in ("FastGelu", "BiasGelu") for n in nodes),
        "gelu": sum(n.op_type == "Gelu" for n in nodes),
    }


def generic_feeds(sess: Any, b: int, s: int, p: int, vocab: int, seed: int = 1):
    """Feeds for any decoder I/O layout: per-tensor [B, H, P, D] or stacked [2, B, H, P, D]."""
    rng = np.random.default_rng(seed)
    has_past = any("past" in i.name for i in sess.get_inputs())
    feeds: dict[str, np.ndarray] = {}
    for i in sess.get_inputs():
        if i.name == "input_ids":
            feeds[i.name] = rng.integers(0, vocab, (b, s), dtype=np.int64)
        elif i.name == "attention_mask":
            feeds[i.name] = np.ones((b, p + s if has_past else s), np.int64)
        elif i.name == "position_ids":
            feeds[i.name] = np.tile(np.arange(p, p + s, dtype=np.int64), (b, 1))
        elif len(i.shape) == 5:
            feeds[i.name] = rng.standard_normal((2, b, i.shape[2], p, i.shape[4]), np.float32)
        else:
            feeds[i.name] = rng.standard_normal((b, i.shape[1], p, i.shape[3]), np.float32)
    return feeds


def stacked_past(model: Any) -> Any:
    """`model` wrapped with onnxruntime gpt2_helper's I/O (its MyGPT2Model): input_ids,
    position_ids, attention_mask, past_{i} stacked [2, B, H, P, Dh] -> logits, present_{i}."""
    import torch
    from transformers import DynamicCache

    class StackedPast(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, input_ids, position_ids, attention_mask, *past):
            cache = DynamicCache()
            for i, kv in enumerate(past):
                cache.update(kv[0], kv[1], i)
            out = self.m(
                input_ids=input_ids,
                position_ids=position_ids,
                attention_mask=attention_mask,
                past_key_values=cache,
                use_cache=True,
            )
            layers = out.past_key_values.layers
            return (out.logits, *(torch.stack([x.keys, x.values]) for x in layers))

    return StackedPast(model)


def random_gpt2(attn: str = "eager", seed: int = 0, **config: Any) -> Any:
    """HF GPT-2 with random weights whose biases and LayerNorm parameters are non-trivial too.

    Why: GPT-2 initialises every bias to 0 and LayerNorm to (1, 0); an export of such a model
    constant-folds the bias Adds away, so bias fusions (BiasGelu, SkipLayerNorm's bias) and
    per-layer norm weights would never be exercised, unlike in a trained checkpoint.
    """
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.GPT2Config(**config)
    model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "bias" in name or "ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def export_gpt2_stacked(
    path: Path, model: Any = None, batch: int = 2, seq: int = 3, past: int = 4, **config: Any
) -> Path:
    """GPT-2 (`model`, else `random_gpt2(**config)`, eager attention) exported by TorchScript
    (opset 14) with gpt2_helper's stacked past: dims batch/seq/total/past are dynamic."""
    import torch

    model = model if model is not None else random_gpt2(**config)
    cfg = model.config
    n, h, d = cfg.n_layer, cfg.n_head, cfg.n_embd // cfg.n_head
    names = [f"past_{i}" for i in range(n)]
    outs = ["logits", *(f"present_{i}" for i in range(n))]
    axes = {
        "input_ids": {0: "batch", 1: "seq"},
        "position_ids": {0: "batch", 1: "seq"},
        "attention_mask": {0: "batch", 1: "total"},
        "logits": {0: "batch", 1: "seq"},
        **{k: {1: "batch", 3: "past"} for k in names},
        **{k: {1: "batch", 3: "total"} for k in outs[1:]},
    }
    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    args = (
        ids,
        torch.arange(past, past + seq).expand(batch, seq),
        torch.ones(batch, past + seq, dtype=torch.int64),
    )
    kv = [torch.randn(2, batch, h, past, d) for _ in range(n)]
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            stacked_past(model),
            (*args, *kv),
            str(path),
            dynamo=False,
            opset_version=14,
            input_names=["input_ids", "position_ids", "attention_mask", *names],
            output_names=outs,
            dynamic_axes=axes,
        )
    return path


def _optimize(tool: str, src: Path, out: Path, heads: int = 0, hidden: int = 0) -> Path:
    import onnx_ir as ir

    out.parent.mkdir(parents=True, exist_ok=True)
    if tool == "input":
        return src
    if tool == "specport":
        from specport.passes.pipelines import optimize_model, save_model

        model, _ = optimize_model(src, "cpu")
        return save_model(model, out)
    if tool == "onnxscript":
        from onnxscript.rewriter.ort_fusions import optimize_for_ort

        model = ir.load(str(src))
        optimize_for_ort(model)
        ir.save(model, out, external_data=out.name + ".data")
        return out
    from onnxruntime.transformers.optimizer import optimize_model as ort_optimize

    opt = ort_optimize(
        str(src), model_type="gpt2", num_heads=heads, hidden_size=hidden, opt_level=1
    )
    opt.save_model_to_file(str(out), use_external_data_format=True)
    return out


def run_exports_bench(
    root: Path, repeat: int = 20, threads: int = 1, big: bool = True, only: str | None = None
) -> dict[str, Any]:
    """One row per (input, tool): fused attention, Softmax left, nodes, decode/prefill ms.
    `only`: keep the inputs whose name contains this string."""
    import onnx

    from tests.passes.graph_models import cpu_session

    # name -> (path, vocab, heads, hidden); heads/hidden are given to onnxruntime's optimizer
    inputs: dict[str, tuple[Path, int, int, int]] = {
        p.stem: (p, 128, 4, 32) for p in sorted(fixtures_dir().glob("*.onnx"))
    }
    if big:
        gpt2 = root / "bench_gpt2_ts_stacked_bias" / "model.onnx"
        if not gpt2.exists():
            export_gpt2_stacked(
                gpt2, n_embd=512, n_layer=8, n_head=8, vocab_size=8192, n_positions=1024
            )
        inputs["ts_gpt2_past_eager_8x512"] = (gpt2, 8192, 8, 512)
        heads, hidden = int(BENCH_CONFIG["num_attention_heads"]), int(BENCH_CONFIG["hidden_size"])
        inputs["dynamo_llama_8x512"] = (
            export_llama30m(root),
            int(BENCH_CONFIG["vocab_size"]),
            heads,
            hidden,
        )
    if only:
        inputs = {k: v for k, v in inputs.items() if only in k}
    rows: dict[str, dict[str, Any]] = {}
    decode: dict[str, Any] = {}
    prefill: dict[str, Any] = {}
    for name, (src, vocab, heads, hidden) in inputs.items():
        for tool in TOOLS:
            key = f"{name}|{tool}"
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    out = root / "exports" / name / tool / "model.onnx"
                    path = _optimize(tool, src, out, heads, hidden)
                proto = onnx.load(str(path), load_external_data=False)
                sess = cpu_session(path, threads=threads)
            except Exception as e:  # noqa: BLE001 - a tool failing on an input is a finding
                rows[key] = {"error": f"{type(e).__name__}: {str(e)[:160]}"}
                logger.warning("%s on %s failed: %s", tool, name, e)
                continue
            has_past = any("past" in i.name for i in sess.get_inputs())
            rows[key] = {
                "fused_attention": fused_attention(proto),
                "softmax_left": sum(n.op_type == "Softmax" for n in proto.graph.node),
                **fused_other(proto),
                "nodes": len(proto.graph.node),
            }
            past = 64 if has_past else 0  # without a cache, one token attends to itself only
            decode[key] = bound_run(sess, generic_feeds(sess, 1, 1, past, vocab), False)
            prefill[key] = bound_run(sess, generic_feeds(sess, 1, 64, 0, vocab), False)
    for key, t in interleaved(decode, repeat).items():
        rows[key]["decode_ms"] = t["median_ms"]
    for key, t in interleaved(prefill, max(5, repeat // 2)).items():
        rows[key]["prefill_ms"] = t["median_ms"]
    return {"threads": threads, "repeat": repeat, "rows": rows}


def print_table(res: dict[str, Any]) -> None:
    print(
        "| input | tool | fused attention | Softmax left | SkipNorm (with bias) | bias+Gelu "
        "(bare Gelu) | nodes | decode ms | prefill ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for key, r in res["rows"].items():
        name, tool = key.split("|")
        if "error" in r:
            print(f"| {name} | {tool} | failed: {r['error']} | | | | | | |")
            continue
        print(
            f"| {name} | {tool} | {r['fused_attention']} | {r['softmax_left']} "
            f"| {r['skip_norm']} ({r['skip_norm_bias']}) | {r['bias_gelu']} ({r['gelu']}) "
            f"| {r['nodes']} "
            f"| {r.get('decode_ms', float('nan')):.3f} | {r.get('prefill_ms', float('nan')):.3f} |"
        )


def default_root() -> Path:
    return Path(tempfile.gettempdir()) / "specport_bench_exports"
