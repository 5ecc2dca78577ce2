"""Export a source model to an artifact: load, trace to ONNX, rewrite, verify, write atomically.

The order matters: passes run before verification so the numbers in the manifest describe the
graph that ships, not an intermediate one.
"""

from __future__ import annotations

import gc
import logging
import os
from pathlib import Path
from typing import Any

from specport.artifact import manifest as art
from specport.artifact.files import write_artifact_manifest
from specport.artifact.optimum_config import save_source_config
from specport.core.contract import TREE_MASK
from specport.core.errors import ExportError
from specport.core.progress import Stages
from specport.exporter import source as src_mod
from specport.exporter.checkpoint import probe_kv_shapes_meta, streaming_model
from specport.exporter.dtype import (
    convert_graph,
    cpu_note,
    resolve_dtype,
    tolerance,
    verification_plan,
)
from specport.exporter.export_passes import apply_passes
from specport.exporter.kv_layout_choice import (
    TREE_MASK_INFO,
    auto_fallback,
    auto_layout,
    check_kv_layout,
    check_tree_mask,
    check_tree_model,
    shared_buffer_length,
    tree_passes,
)
from specport.exporter.onnx_attention import tracing
from specport.exporter.onnx_graph import (
    OPSET,
    io_signature,
    save_artifact_model,
    trace_to_onnx,
    verification_session,
)
from specport.exporter.qnn_context import check_qnn
from specport.exporter.registry import check_supported
from specport.exporter.static_graphs import plan, write_qnn_graphs
from specport.exporter.tokenizer_files import copy_tokenizer
from specport.exporter.verify import compare, reference_cases
from specport.exporter.wrapper import probe_kv_shapes
from specport.passes.quant.inline import check_inline, quantize_inline

logger = logging.getLogger(__name__)


def export_model(
    model: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    tokenizer: str | os.PathLike[str] | None = None,
    target: str = "cpu",
    fuse: bool = True,
    passes: list[str] | None = None,
    skip_verify: bool = False,
    layers: int | None = None,
    progress: bool | None = None,
    kv_layout: str = "auto",
    max_length: int | None = None,
    tree_mask: bool = False,
    quant: str | None = None,
    quant_algo: str = "hqq",
    dtype: str = "fp32",
    soc: int | None = None,
    context_length: int | None = None,
    prefill_chunk: int | None = None,
) -> art.Manifest:
    """Export `model` (HF dir, cached hub id, GGUF file or llama2c .bin) to the artifact `out`.

    `kv_layout="auto"` (the default) picks `shared` wherever onnxruntime's fused attention runs
    the model (target cpu/cuda, fusion on, head dims GroupQueryAttention accepts) and `concat`
    elsewhere; the manifest's `kv_layout_choice` and `specport inspect` say why.
    `kv_layout="shared"` (target cpu/cuda) ships the runtime's fast path: one in-place KV buffer
    per layer of up to `max_length` positions (default min(context, 4096)), `logits_index` in
    and greedy `next_token` out (passes/shared_kv.py, passes/select_logits.py).
    `tree_mask=True` adds the `tree_mask` int64 [B, S, S] input (speculative tree
    verification: new token i attends new token j iff 1; feed a lower-triangular mask for
    plain causal runs; feed position ids P + depth). On the concat layout attention is then
    left unfused (the traced mask carries the tree); on the shared layout the fused attention
    takes the tree as its attention bias (passes/tree_bias.py); `auto` picks shared unless the
    model has a sliding window (the fused kernel's window counts slots, not tree depths).
    `quant` (w4a8, w4a16, w8a16; `quant_algo` rtn or hqq) quantizes the weights as they are
    read, one layer at a time (passes/quant/inline.py): with a safetensors checkpoint the float
    model is never held, in memory or on disk. Such an artifact cannot equal PyTorch, so its
    verification is skipped (measure it with `specport eval ppl` / `eval compare`).
    `dtype` ("fp32" default, "fp16", "bf16"; exporter/dtype.py) converts weights, activations
    and the KV cache after the passes (logits stay float32) and verifies with a tolerance for
    that dtype; bf16 is refused for the cpu target (onnxruntime's CPU provider has no bfloat16
    MatMul) and is not verified on a machine without it.
    `target="qnn"` (exporter/static_graphs.py) also writes static prefill/decode graphs of batch
    1 for a fixed `context_length` (default min(model's, 1024)) and `prefill_chunk` (default
    64) sharing model.onnx.data, and with `soc` (e.g. 60 = Snapdragon X Elite) compiles them
    into QNN EPContext models for that SoC (needs onnxruntime-qnn).
    Raises ExportError when verification against PyTorch is over tolerance (unless skipped).
    """
    _check_static(target, soc, context_length, prefill_chunk)
    dtype = resolve_dtype(dtype, target, quant)
    no_verify_reason: str | None = None
    if dtype != "float32":
        can_verify, no_verify_reason = verification_plan(dtype, target)
        skip_verify = skip_verify or not can_verify
    requested = kv_layout
    kv_layout, why = auto_layout(kv_layout, target, fuse, passes)
    check_kv_layout(kv_layout, target, fuse)  # before any slow step
    check_tree_mask(tree_mask, kv_layout, passes)
    qnn_quant, quant = (quant, None) if target == "qnn" else (None, quant)
    if qnn_quant is not None:  # QDQ on the static graphs, after verification of the float one
        from specport.exporter.qnn_quant import check_scheme

        check_scheme(qnn_quant)
    if quant is not None:
        check_inline(quant, quant_algo)
        skip_verify = True
    stages = Stages(total=5, show=progress)
    stages.start("resolving source model")
    source = src_mod.resolve(model, tokenizer, progress=stages.show)
    check_supported(source.arch, source.config)
    stages.start("preparing the PyTorch model")
    streamed = streaming_model(source, layers)
    if streamed is not None:  # weights stay in the checkpoint until written (checkpoint.py)
        torch_model, checkpoint, bindings = streamed
        kv_shapes = probe_kv_shapes_meta(torch_model)
    else:
        torch_model = src_mod.load_model(source, num_layers=layers, progress=stages.show)
        checkpoint, bindings = None, None
        kv_shapes = probe_kv_shapes(torch_model)
    config = torch_model.config
    norm = source.arch.normalize(config)
    num_layers = len(kv_shapes)
    norm["num_layers"] = num_layers
    if requested == "auto" and kv_layout == "shared":  # known before tracing: no second trace
        kv_layout, why = auto_fallback(kv_shapes, config, tree_mask, kv_layout, why)
        check_tree_mask(tree_mask, kv_layout, passes)
    if tree_mask:
        check_tree_model(config, kv_layout)
    static = None
    if target == "qnn":
        static = plan(context_length, prefill_chunk, int(norm.get("context_length") or 0))

    stages.start("exporting to ONNX (torch.onnx.export, dynamo)")
    # The shared layout traces the plain graph (its attention must fuse) and adds the tree
    # afterwards as the fused attention's bias; concat traces the tree mask into attention.
    with tracing(torch_model, source.arch.trace_onnx_attention):
        ir_model = trace_to_onnx(
            torch_model,
            kv_shapes,
            norm["vocab_size"],
            tree_mask=tree_mask and kv_layout == "concat",
            checkpoint=checkpoint,
            bindings=bindings,
        )

    stages.start("rewriting the graph")
    buffer_length = shared_buffer_length(kv_layout, kv_shapes, norm, max_length)
    if tree_mask and fuse and passes is None and kv_layout == "concat":
        passes = tree_passes(target)
    try:
        pass_reports, kv, target_used, runtime_io = apply_passes(
            ir_model, target, fuse, passes, norm, kv_shapes, kv_layout, buffer_length, tree_mask
        )
    except ExportError as e:
        if requested != "auto" or kv_layout != "shared":
            raise
        # auto: a model the fused attention does not cover keeps the portable layout
        logger.info("KV layout auto -> concat: %s", e)
        kv_layout, why = "concat", f"not every attention fused to GroupQueryAttention ({e})"
        ir_model = trace_to_onnx(torch_model, kv_shapes, norm["vocab_size"], tree_mask=tree_mask)
        if tree_mask and fuse and passes is None:
            passes = tree_passes(target)
        pass_reports, kv, target_used, runtime_io = apply_passes(
            ir_model, target, fuse, passes, norm, kv_shapes, kv_layout, None
        )
    if tree_mask:
        runtime_io[TREE_MASK] = TREE_MASK_INFO
    quant_info = None
    if quant is not None:
        reports, quant_info = quantize_inline(ir_model, quant, quant_algo)
        pass_reports = [*pass_reports, *reports]
    if dtype != "float32":
        pass_reports = [*pass_reports, convert_graph(ir_model, dtype, target)]
        past = next(v for v in ir_model.graph.inputs if v.name == kv.inputs[0][0])
        kv.dtype = past.dtype.numpy().name if past.dtype is not None else dtype
        if cpu_note(dtype, target):
            logger.info("--dtype %s: %s", dtype, cpu_note(dtype, target))

    references = (
        None
        if skip_verify or streamed is not None
        else reference_cases(torch_model, kv_shapes, norm["vocab_size"], tree_mask=tree_mask)
    )
    extra = source.arch.extra_weights(source.path, config)
    # From here on only the ONNX graph holds the weights: free the PyTorch copy before
    # onnxruntime loads its own (peak memory stays near one copy of the weights).
    del torch_model, streamed
    gc.collect()

    with art.atomic_artifact_dir(Path(out)) as tmp:
        save_artifact_model(ir_model, tmp / art.MODEL_NAME)
        del ir_model
        gc.collect()
        tok_info = _copy_tokenizer(source.path, tmp)
        save_source_config(config, tmp)  # Optimum's config.json (kept consistent: interop.py)
        extra_files: dict[str, Any] = {}
        if extra:
            from safetensors.torch import save_file

            save_file(
                {k: v.contiguous() for k, v in extra.items()}, str(tmp / "mtp_source.safetensors")
            )
            extra_files["mtp_source_weights"] = {
                "file": "mtp_source.safetensors",
                "tensors": len(extra),
            }
            del extra

        stages.start("verifying against PyTorch")
        if checkpoint is not None and not skip_verify:
            # The graph is on disk and its weights are freed: now the PyTorch model may load.
            real = src_mod.load_model(source, num_layers=layers, progress=stages.show)
            references = reference_cases(real, kv_shapes, norm["vocab_size"], tree_mask=tree_mask)
            del real
            gc.collect()
        if references is None:
            verify: dict[str, Any] = {"skipped": True}
            if quant is not None:
                verify["reason"] = (
                    "weights quantized during export: compare with `specport eval compare`"
                )
            elif dtype != "float32" and no_verify_reason:
                verify["reason"] = no_verify_reason
        else:
            session = verification_session(tmp / art.MODEL_NAME)
            atol, rtol = source.arch.atol, source.arch.rtol
            if dtype != "float32":
                atol, rtol = (max(a, b) for a, b in zip((atol, rtol), tolerance(dtype, target)))
            verify = compare(session, references, atol=atol, rtol=rtol)
            del session, references
            if not verify["ok"]:
                raise ExportError(
                    f"exported graph disagrees with PyTorch: max |logits diff| = {verify['max_abs_logits']:.3g} "
                    f"(tolerance {atol} + {rtol}·max|logits|). This is a bug in the "
                    "export or a pass; re-run with --no-fuse to isolate it, or --skip-verify to keep the artifact anyway."
                )
        if static is not None:
            bos = norm.get("bos_token_id")
            runtime_io["static"] = write_qnn_graphs(
                tmp, art.MODEL_NAME, static, soc, qnn_quant, bos
            )
        manifest = art.Manifest(
            architecture=norm["model_type"],
            config=norm,
            io=io_signature(tmp / art.MODEL_NAME),
            kv=kv,
            source=source.describe() | ({"layers_kept": layers} if layers else {}),
            opset=OPSET,
            dtype=dtype,
            target=target_used,
            tokenizer=tok_info,
            passes=pass_reports,
            verify=verify,
            quant=quant_info,
            extra={
                "export": {"seconds": stages.done()},
                "kv_layout_choice": {"requested": requested, "layout": kv.layout, "reason": why},
                **({"dtype_note": note} if (note := cpu_note(dtype, target)) else {}),
                **extra_files,
                **runtime_io,
            },
        )
        write_artifact_manifest(tmp, manifest)
    logger.info("artifact written to %s", out)
    return manifest


def _check_static(
    target: str, soc: int | None, context_length: int | None, prefill_chunk: int | None
) -> None:
    """Before any slow step: the static options belong to target qnn, and a SoC needs QNN."""
    if target != "qnn":
        options = {"--soc": soc, "--context-length": context_length}
        options["--prefill-chunk"] = prefill_chunk
        given = [name for name, value in options.items() if value is not None]
        if given:
            raise ExportError(f"{', '.join(given)} apply to --target qnn only.")
        return

    check_qnn(soc)


def _copy_tokenizer(source_dir: Path, out: Path) -> dict[str, Any]:
    return copy_tokenizer(source_dir, out)
