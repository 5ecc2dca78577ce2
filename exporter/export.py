"""Export a source model to an artifact: load, trace to ONNX, rewrite, verify, write atomically.

The order matters: passes run before verification so the numbers in the manifest describe the
graph that ships, not an intermediate one.
"""

from __future__ import annotations

import gc
import logging
import os
import time
import warnings
from pathlib import Path
from typing import Any

import onnx_ir as ir

from specport import artifact as art
from specport.contract import TREE_MASK
from specport.errors import ExportError
from specport.exporter import source as src_mod
from specport.exporter.checkpoint import probe_kv_shapes_meta, streaming_model
from specport.exporter.dtype import (
    convert_graph,
    cpu_note,
    resolve_dtype,
    tolerance,
    verification_plan,
)
from specport.exporter.onnx_attention import tracing
from specport.exporter.optimum_config import save_source_config
from specport.exporter.registry import check_supported
from specport.exporter.verify import compare, reference_cases
from specport.exporter.weights import detach_weights, fold_weight_transposes, release_weights
from specport.exporter.wrapper import (
    FlatKVWrapper,
    TreeMaskKVWrapper,
    dynamic_shapes,
    example_inputs,
    kv_input_names,
    kv_output_names,
    probe_kv_shapes,
)
from specport.progress import Stages

logger = logging.getLogger(__name__)

OPSET = 23


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
    Raises ExportError when verification against PyTorch is over tolerance (unless skipped).
    """
    dtype = resolve_dtype(dtype, target, quant)
    no_verify_reason: str | None = None
    if dtype != "float32":
        can_verify, no_verify_reason = verification_plan(dtype, target)
        skip_verify = skip_verify or not can_verify
    requested = kv_layout
    kv_layout, why = _auto_layout(kv_layout, target, fuse, passes)
    _check_kv_layout(kv_layout, target, fuse)  # before any slow step
    _check_tree_mask(tree_mask, kv_layout, passes)
    if quant is not None:
        from specport.passes.quant.inline import check_inline

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
        kv_layout, why = _auto_fallback(kv_shapes, config, tree_mask, kv_layout, why)
        _check_tree_mask(tree_mask, kv_layout, passes)
    if tree_mask:
        _check_tree_model(config, kv_layout)

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
    buffer_length = _shared_buffer_length(kv_layout, kv_shapes, norm, max_length)
    if tree_mask and fuse and passes is None and kv_layout == "concat":
        passes = _tree_passes(target)
    try:
        pass_reports, kv, target_used, runtime_io = _apply_passes(
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
            passes = _tree_passes(target)
        pass_reports, kv, target_used, runtime_io = _apply_passes(
            ir_model, target, fuse, passes, norm, kv_shapes, kv_layout, None
        )
    if tree_mask:
        runtime_io[TREE_MASK] = TREE_MASK_INFO
    quant_info = None
    if quant is not None:
        from specport.passes.quant.inline import quantize_inline

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
        manifest = art.Manifest(
            architecture=norm["model_type"],
            config=norm,
            io=_io_signature(tmp / art.MODEL_NAME),
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
        art.write_manifest(tmp, manifest)
    logger.info("artifact written to %s", out)
    return manifest


def verification_session(path: Path) -> Any:
    """An onnxruntime CPU session for `compare` that adds no copy of the weights.

    onnxruntime maps the external data file; by default it then repacks every MatMul weight
    into a private buffer and folds the tied LM head's Transpose into a new initializer (one
    more copy of the weights, plus the embedding again). Verification runs a few tiny
    batches, so it reads the mapped weights as they are (same kernels' arithmetic, without
    the packed layout): peak memory stays at one, file-backed, copy.
    """
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.add_session_config_entry("session.disable_prepacking", "1")
    return ort.InferenceSession(
        str(path),
        so,
        providers=["CPUExecutionProvider"],
        disabled_optimizers=["ConstantFolding"],
    )


def trace_to_onnx(
    torch_model: Any,
    kv_shapes: list[tuple[int, int, int]],
    vocab_size: int,
    tree_mask: bool = False,
    checkpoint: Any = None,
    bindings: dict[int, str] | None = None,
) -> ir.Model:
    """torch.onnx.export (dynamo) of the flat-KV wrapper; weights become lazy initializers.

    With `checkpoint` and `bindings` (from `streaming_model`) the model's parameters hold no
    data and every initializer reads its tensor from the checkpoint when written.
    """
    import torch

    num_layers = len(kv_shapes)
    # torch's exporter logs one line per optional op library it cannot find (torchvision).
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    wrapper_cls = TreeMaskKVWrapper if tree_mask else FlatKVWrapper
    wrapper = wrapper_cls(torch_model, num_layers).eval()
    args = example_inputs(vocab_size, kv_shapes, tree_mask=tree_mask)
    t0 = time.perf_counter()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        try:
            program = torch.onnx.export(
                wrapper,
                args,
                dynamic_shapes=dynamic_shapes(num_layers, tree_mask=tree_mask),
                dynamo=True,
                opset_version=OPSET,
                input_names=[
                    "input_ids",
                    "attention_mask",
                    "position_ids",
                    *([TREE_MASK] if tree_mask else []),
                    *kv_input_names(num_layers),
                ],
                output_names=["logits", *kv_output_names(num_layers)],
                verbose=False,
                # The default optimize=True folds every weight Transpose into a fresh array
                # while the PyTorch model still holds the weights (a second full copy).
                # Fold them lazily instead, then run the same optimizer (weights.py).
                optimize=False,
            )
            if program is None:
                raise ExportError("torch.onnx.export returned no program; upgrade torch (>= 2.6).")
            detach_weights(program.model, checkpoint=checkpoint, bindings=bindings)
            fold_weight_transposes(program.model)
            program.optimize()
        except ExportError:
            raise
        except Exception as e:  # noqa: BLE001 - the exporter raises many kinds
            raise ExportError(
                f"torch.onnx.export failed for {type(torch_model).__name__}: {e}"
            ) from e
    logger.info("traced in %.1fs", time.perf_counter() - t0)
    model = program.model
    # The initializers are views of the PyTorch parameters (or lazy transposes of them): drop
    # the ExportedProgram so nothing else pins a copy.
    del program
    model.producer_name = "specport"
    return model


def save_artifact_model(model: ir.Model, path: Path, release: bool = True) -> None:
    """Write `model` with its weights as external data, one tensor in flight at a time.

    onnx_ir writes with a thread pool and up to 1 GiB of tensors materialized at once; lazily
    transposed weights are materialized on write, so one worker keeps the transient to the
    largest single tensor. `release` then empties the in-memory initializers (the model is
    unusable afterwards) so the weights are freed before onnxruntime loads the saved copy.
    """
    ir.save(model, path, external_data=art.DATA_NAME, max_workers=1)
    if release:
        release_weights(model)


SHARED_MAX_LENGTH = 4096  # default KV buffer limit of a shared-layout artifact

# manifest["tree_mask"] of an artifact exported with tree_mask=True (the runtime checks the
# graph input itself; this record is for people and other tools reading the manifest).
TREE_MASK_INFO = {
    "input": TREE_MASK,
    "dtype": "int64",
    "shape": ["batch", "sequence_length", "sequence_length"],
    "meaning": "1 = new token i may attend new token j; lower-triangular = plain causal",
}
# The fused attention op derives a causal mask from attention_mask: it would drop the tree.
TREE_UNFUSABLE = ("fuse_attention",)


def _check_tree_mask(tree_mask: bool, kv_layout: str, passes: list[str] | None) -> None:
    """Refuse tree-mask options no graph can honour (before loading anything)."""
    if not tree_mask or kv_layout != "concat":  # shared: the fused attention takes the tree
        return
    bad = [p for p in passes or [] if p in TREE_UNFUSABLE]
    if bad:
        raise ExportError(
            f"--tree-mask cannot run pass(es) {bad}: the fused attention builds its own causal "
            "mask and would ignore the tree. Drop them from --passes."
        )


def _auto_fallback(
    kv_shapes: list[tuple[int, int, int]], config: Any, tree_mask: bool, layout: str, why: str
) -> tuple[str, str]:
    """auto: (layout, why) once the model is known: concat where the fused path cannot go."""
    if _bad_head_dims(kv_shapes):
        return "concat", (
            f"head dims {_bad_head_dims(kv_shapes)} (key, value): onnxruntime's "
            "GroupQueryAttention needs equal dims that are a multiple of 16"
        )
    if tree_mask and _tree_window(config) is not None:
        return "concat", (
            "--tree-mask on a sliding-window model: the fused attention's window counts buffer "
            "slots, not tree depths"
        )
    return layout, why


def _tree_window(config: Any) -> int | None:
    """The sliding window a tree mask must reproduce (None: full attention, or unsupported)."""
    from specport.exporter.wrapper import sliding_layout

    try:
        return sliding_layout(config)[0]
    except ValueError:
        return None  # _check_tree_model refuses it with its message


def _check_tree_model(config: Any, kv_layout: str = "concat") -> None:
    """The tree mask replaces HF's masks: refuse layer kinds it cannot reproduce.

    On the shared layout the fused attention's sliding window counts cache slots, and a tree
    node's slot (P + node index) lies past its position (P + depth): it would see less of the
    past than a chain run of its path, so sliding-window models keep the concat layout.
    """
    from specport.exporter.wrapper import sliding_layout

    try:
        window, _ = sliding_layout(config)
    except ValueError as e:
        raise ExportError(
            f"--tree-mask supports full and sliding-window attention layers; this model has {e}. "
            "Export without --tree-mask and use chain speculative decoding."
        ) from e
    if window is not None and kv_layout == "shared":
        raise ExportError(
            f"--tree-mask on --kv-layout shared needs full attention; this model has a sliding "
            f"window of {window}. Use --kv-layout concat with --tree-mask for this model."
        )


def _tree_passes(target: str) -> list[str]:
    """The target's pipeline minus the passes that would drop the tree mask."""
    from specport.passes.pipelines import pipeline_for

    names = [p.name for p in pipeline_for(target).passes]
    return [n for n in names if n not in TREE_UNFUSABLE]


def _auto_layout(
    kv_layout: str, target: str, fuse: bool, passes: list[str] | None
) -> tuple[str, str]:
    """(layout, why) for `kv_layout` ("auto" resolves here; head dims are checked later)."""
    if kv_layout != "auto":
        return kv_layout, f"--kv-layout {kv_layout} was asked for"
    if target not in ("cpu", "cuda"):
        return (
            "concat",
            f"target {target}: the in-place layout needs onnxruntime's cpu/cuda kernels",
        )
    if not fuse:
        return "concat", "--no-fuse: the in-place layout needs the fused attention"
    if passes is not None and "fuse_attention" not in passes:
        return "concat", "--passes without fuse_attention: the in-place layout needs it"
    return "shared", "onnxruntime's fused attention runs this model in place (the fast path)"


def _bad_head_dims(kv_shapes: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
    return sorted({(k, v) for _, k, v in kv_shapes if k != v or k % 16})


def _check_kv_layout(kv_layout: str, target: str, fuse: bool) -> None:
    """Refuse a KV layout the passes cannot make for this target (before loading anything)."""
    if kv_layout == "concat":
        return
    if kv_layout != "shared":
        raise ExportError(f"unknown KV layout {kv_layout!r}: choose 'auto', 'concat' or 'shared'.")
    if target not in ("cpu", "cuda"):
        raise ExportError(
            f"--kv-layout shared needs onnxruntime's GroupQueryAttention (target cpu or cuda), "
            f"not target {target!r}; use --kv-layout concat for {target!r}."
        )
    if not fuse:
        raise ExportError(
            "--kv-layout shared needs the fusion passes (attention -> GroupQueryAttention); "
            "drop --no-fuse, or use --kv-layout concat."
        )


def _shared_buffer_length(
    kv_layout: str,
    kv_shapes: list[tuple[int, int, int]],
    config: dict[str, Any],
    max_length: int | None,
) -> int | None:
    """The shared layout's KV limit (None for concat); refuses head dims GQA cannot run."""
    if kv_layout != "shared":
        return None
    bad = _bad_head_dims(kv_shapes)
    if bad:
        raise ExportError(
            f"--kv-layout shared runs attention as onnxruntime's GroupQueryAttention, which needs "
            f"equal key/value head dims that are a multiple of 16; this model has (key, value) "
            f"head dims {bad}. Use --kv-layout concat for this model."
        )
    context = int(config.get("context_length") or SHARED_MAX_LENGTH)
    if max_length is None:
        return min(context, SHARED_MAX_LENGTH)
    if not 1 <= max_length <= context:
        raise ExportError(
            f"--max-length {max_length} is outside 1..{context} (the model's context length)."
        )
    return max_length


def _apply_passes(
    model: ir.Model,
    target: str,
    fuse: bool,
    passes: list[str] | None,
    config: dict[str, Any],
    kv_shapes: list[tuple[int, int, int]],
    kv_layout: str = "concat",
    max_length: int | None = None,
    tree_mask: bool = False,
) -> tuple[list[dict[str, Any]], art.KVLayout, str, dict[str, Any]]:
    """Run the target's pipeline. Returns (pass reports, manifest KVLayout, target, extra).

    `extra` is `{"runtime": ...}` for a shared layout (the names the runtime binds), else {}.
    """
    layout = art.KVLayout(
        layout="concat",
        inputs=[
            [f"past_key_values.{i}.key", f"past_key_values.{i}.value"]
            for i in range(len(kv_shapes))
        ],
        outputs=[[f"present.{i}.key", f"present.{i}.value"] for i in range(len(kv_shapes))],
        num_heads=[h for h, _, _ in kv_shapes],
        key_dim=[k for _, k, _ in kv_shapes],
        value_dim=[v for _, _, v in kv_shapes],
    )
    if kv_layout == "shared":
        return _apply_shared(model, target, passes, kv_shapes, max_length, tree_mask)
    if not fuse and not passes:
        return [], layout, "neutral", {}
    try:
        from specport.passes.pipelines import pipeline_for
    except ImportError:
        logger.info("no pass pipelines available; exporting unfused")
        return [], layout, "neutral", {}
    pipeline = pipeline_for(target, passes)
    result = pipeline(model)
    return result.report.get("passes", []), layout, target, {}


def _apply_shared(
    model: ir.Model,
    target: str,
    passes: list[str] | None,
    kv_shapes: list[tuple[int, int, int]],
    max_length: int | None,
    tree_mask: bool = False,
) -> tuple[list[dict[str, Any]], art.KVLayout, str, dict[str, Any]]:
    """Fuse, lower, switch to the shared layout and select logits; refuse a partial fusion.

    The graph keeps its buffer length symbolic (the runtime allocates what a generation needs);
    `max_length` is the artifact's limit, recorded in the manifest.
    """
    from specport.passes.io_contract import fused_io_contract, kv_layout_fields
    from specport.passes.pipelines import pipeline_for
    from specport.passes.select_logits import LOGITS_INDEX, NEXT_TOKEN, RUNTIME_IO

    pipeline = pipeline_for(
        target,
        passes,
        kv_layout="shared",
        select_logits=True,
        rotary_length=max_length,
        pack_qkv=True,
        tree_mask=tree_mask,
    )
    result = pipeline(model)
    contract = fused_io_contract(model)
    fused = contract["attention"].get("com.microsoft.GroupQueryAttention", 0)
    if contract["layout"] != "shared" or fused != len(kv_shapes):
        other = {k: v for k, v in contract["attention"].items() if "GroupQuery" not in k}
        raise ExportError(
            f"--kv-layout shared needs every layer's attention fused to GroupQueryAttention; "
            f"{fused} of {len(kv_shapes)} layers fused (other attention ops: {other or 'none'}). "
            "Use --kv-layout concat for this model (or keep fuse_attention in --passes)."
        )
    if tree_mask and TREE_MASK not in contract["graph_inputs"]:
        why = next(
            (p.get("skipped") for p in result.report.get("passes", []) if p["name"] == "tree_bias"),
            None,
        )
        raise ExportError(
            f"--tree-mask could not reach the fused attention ({why or 'tree_bias did not run'}); "
            "use --kv-layout concat with --tree-mask for this model."
        )
    fields = kv_layout_fields(contract)
    fields["max_length"] = max_length
    past = next(v for v in model.graph.inputs if v.name == contract["inputs"][0][0])
    if past.dtype is not None:  # numpy's name ("float32"), which the runtime allocates with
        fields["dtype"] = past.dtype.numpy().name
    graph_in = {v.name for v in model.graph.inputs}
    graph_out = {v.name for v in model.graph.outputs}
    runtime = dict(RUNTIME_IO)
    if LOGITS_INDEX not in graph_in:
        runtime.pop("logits_index_input")
    if NEXT_TOKEN not in graph_out:
        runtime.pop("next_token_output")
    runtime["position_ids"] = "position_ids" in graph_in
    runtime["feeds"] = contract["feeds"]
    runtime["multi_token_on_past"] = contract["multi_token_on_past"]
    return (
        result.report.get("passes", []),
        art.KVLayout(**fields),
        target,
        {"runtime": runtime},
    )


def _copy_tokenizer(source_dir: Path, out: Path) -> dict[str, Any]:
    from specport.exporter.tokenizer_files import copy_tokenizer

    return copy_tokenizer(source_dir, out)


def _io_signature(model_path: Path) -> dict[str, list[dict[str, Any]]]:
    import onnx

    proto = onnx.load(str(model_path), load_external_data=False)

    def describe(values: Any) -> list[dict[str, Any]]:
        out = []
        for v in values:
            t = v.type.tensor_type
            dims = [d.dim_param if d.dim_param else d.dim_value for d in t.shape.dim]
            out.append(
                {
                    "name": v.name,
                    "dtype": onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name,
                    "shape": dims,
                }
            )
        return out

    return {"inputs": describe(proto.graph.input), "outputs": describe(proto.graph.output)}
