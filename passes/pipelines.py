"""Per-target pass pipelines and `optimize_model`, the one call the API and CLI use.

    neutral  normalize -> fuse_rms_norm -> fuse_skip_norm -> fuse_rotary -> fuse_attention
             -> fuse_gelu -> lower(neutral: specport ops + function bodies)
    cpu/cuda same fusions -> lower(com.microsoft contrib ops) -> cleanup -> fuse_bias (bias
             Adds into FastGelu/BiasGelu and SkipLayerNormalization's bias input)
    cann     same fusions but fuse_gelu -> lower(inline function bodies: standard ops) -> cleanup
    standard same fusions -> lower(ai.onnx only: RMSNormalization, RotaryEmbedding, attention
             as MatMul/Softmax with past/present; `decompose=()` keeps Attention-23) -> cleanup:
             runs in any onnxruntime provider and in OpenVINO
    qnn      as standard with Attention-23 and an fp16-safe mask value
             (exporter/static_graphs.py derives the static prefill/decode graphs)
    kv_layout="shared" (cpu/cuda) appends shared_kv: one preallocated KV buffer per layer,
             pack_projections (sibling MatMuls of one input, e.g. gate/up, as one MatMul + Split)
             and with select_logits=True select_logits (logits_index in, next_token out);
             with tree_mask=True tree_bias (a `tree_mask` input fed to the fused attention as
             its attention_bias, for token-tree verification).

`passes=[...]` picks a subset by name, in pipeline order ("lower" and "normalize" are always
kept: a fused-but-unlowered graph would carry ops the target cannot run).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import onnx
import onnx_ir as ir

from specport.core.errors import PassError
from specport.custom_ops.lowering import TARGETS, unique_names
from specport.passes.base import Pass, Pipeline
from specport.passes.cleanup import CleanupPass, NormalizePass
from specport.passes.fuse_attention import FuseAttentionPass
from specport.passes.fuse_bias import FuseBiasPass
from specport.passes.fuse_gelu import FuseGeluPass
from specport.passes.fuse_rms_norm import FuseRMSNormPass
from specport.passes.fuse_rotary import FuseRotaryPass
from specport.passes.fuse_skip_norm import FuseSkipNormPass
from specport.passes.lower import LowerPass
from specport.passes.pack_projections import PackProjectionsPass
from specport.passes.select_logits import SelectLogitsPass
from specport.passes.shared_kv import SharedKVPass
from specport.passes.tree_bias import TreeBiasPass

logger = logging.getLogger(__name__)

FUSIONS = ("fuse_rms_norm", "fuse_skip_norm", "fuse_rotary", "fuse_attention", "fuse_gelu")
ALWAYS = ("normalize", "lower")


def _make(name: str, target: str, options: dict[str, Any]) -> Pass:
    if name == "normalize":
        return NormalizePass()
    if name == "fuse_rms_norm":
        return FuseRMSNormPass()
    if name == "fuse_skip_norm":
        return FuseSkipNormPass()
    if name == "fuse_rotary":
        return FuseRotaryPass()
    if name == "fuse_attention":
        return FuseAttentionPass(sliding_window=options.get("sliding_window"))
    if name == "fuse_gelu":
        return FuseGeluPass()
    if name == "lower":
        lower_opts = {
            k: options[k] for k in ("rms_norm", "skip_layer_norm", "decompose") if k in options
        }
        return LowerPass(target, **lower_opts)
    if name == "cleanup":
        return CleanupPass()
    if name == "fuse_bias":
        return FuseBiasPass()
    if name == "shared_kv":
        return SharedKVPass(
            options.get("max_length"),
            options.get("rotary_length"),
            pack_qkv=bool(options.get("pack_qkv")),
        )
    if name == "tree_bias":
        return TreeBiasPass()
    if name == "pack_projections":
        return PackProjectionsPass()
    if name == "select_logits":
        return SelectLogitsPass()
    raise PassError(f"unknown pass {name!r}: choose from {', '.join(all_pass_names())}")


def all_pass_names() -> list[str]:
    return [
        "normalize",
        *FUSIONS,
        "lower",
        "cleanup",
        "fuse_bias",
        "shared_kv",
        "tree_bias",
        "pack_projections",
        "select_logits",
    ]


def pipeline_for(target: str, passes: list[str] | None = None, **options: Any) -> Pipeline:
    """The pipeline for `target` (see TARGETS); `passes` restricts it by name.

    Options: `sliding_window` (int or per-attention list), `rms_norm` ("standard"|"contrib"),
    `skip_layer_norm` ("standard": Add + LayerNormalization, the cpu default | "contrib"),
    `kv_layout` ("concat"|"shared", see passes/shared_kv.py),
    `max_length` (buffer length written into shapes for the shared layout; None keeps it
    symbolic so the runtime picks its buffer size), `select_logits` (bool, shared layout only:
    `logits_index` input, LM head on the selected positions, `next_token` argmax output).
    `rotary_length` (shared layout: fold rotary into GroupQueryAttention with cos/sin caches
    for that many positions; position_ids leaves the graph), `pack_qkv` (shared layout: q/k/v
    projections as one MatMul into GQA's packed input), `pack_projections` (shared layout,
    default = pack_qkv: the other sibling float MatMuls of one input, e.g. gate/up, packed
    into one MatMul + Split), `tree_mask` (shared layout: a `tree_mask` [B, S, S] input for
    token-tree verification, passes/tree_bias.py).
    """
    if target not in TARGETS:
        raise PassError(f"unknown target {target!r}: choose one of {', '.join(TARGETS)}")
    names = all_pass_names()
    names.remove("shared_kv")
    names.remove("tree_bias")
    names.remove("pack_projections")
    names.remove("select_logits")
    opt_in: list[str] = []
    if target == "neutral":
        names.remove("cleanup")
    if target not in ("cpu", "cuda"):
        names.remove("fuse_bias")  # its ops are onnxruntime contrib ops
    if target == "cann":
        names.remove("fuse_gelu")  # no Gelu kernel on the CANN EP
    if options.get("kv_layout", "concat") == "shared":
        if target not in ("cpu", "cuda"):
            raise PassError(
                f"kv_layout='shared' needs onnxruntime's GroupQueryAttention: use target "
                f"cpu or cuda, not {target!r}"
            )
        opt_in.append("shared_kv")
        if options.get("tree_mask"):
            opt_in.append("tree_bias")  # the tree_mask input, as attention_bias
        if options.get("pack_projections", options.get("pack_qkv", False)):
            opt_in.append("pack_projections")  # gate/up (q/k/v: shared_kv's pack_qkv)
        if options.get("select_logits"):
            opt_in.append("select_logits")
    if passes is not None:
        unknown = [p for p in passes if p not in all_pass_names()]
        if unknown:
            raise PassError(
                f"unknown pass(es) {unknown}: choose from {', '.join(all_pass_names())}"
            )
        names = [n for n in names if n in passes or n in ALWAYS]
    names += opt_in
    return Pipeline([_make(n, target, options) for n in names], name=f"optimize[{target}]")


def optimize_model(
    model: onnx.ModelProto | ir.Model | str | Path,
    target: str = "cpu",
    passes: list[str] | None = None,
    **options: Any,
) -> tuple[ir.Model, dict[str, Any]]:
    """Fuse and lower `model` for `target`. Returns (onnx_ir model, report).

    A path is loaded with its external data; an `onnx.ModelProto` is converted (not mutated).
    Patterns that do not match leave the graph as it was; the report says which and why.
    """
    if isinstance(model, (str, Path)):
        model = ir.load(str(model))
    elif isinstance(model, onnx.ModelProto):
        model = ir.serde.deserialize_model(model)
    pipeline = pipeline_for(target, passes, **options)
    result = pipeline(model)
    unique_names(result.model)
    report = dict(result.report)
    report["target"] = target
    return result.model, report


def save_model(model: ir.Model, path: str | Path) -> Path:
    """Save with weights in `<name>.data` beside the graph (the artifact convention)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    ir.save(model, str(path), external_data=path.name + ".data")
    return path
