"""Checks that run in about a second, before a command loads weights or starts a long loop.

An export takes 20 s to hours and a quantization up to an hour: a bad option, an unknown pass,
a KV layout the model cannot take or an output that cannot be written must be reported at
once, not at the end. Everything here reads only arguments, paths and config files (never
weights). Messages name options with `specport.core.options.option`, so the CLI shows flags and the
API keyword arguments.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specport.artifact.manifest import read_manifest, refuse_hard_linked_weights, weight_files
from specport.core.errors import InputError, SpecportError, UsageError
from specport.core.onnx_file import check_onnx_input
from specport.core.options import option
from specport.core.outputs import check_artifact_out, check_onnx_out
from specport.exporter.dtype import resolve_dtype
from specport.passes.pipelines import all_pass_names
from specport.passes.quant import checks
from specport.passes.quant.head import check_head_bits

TARGETS = ("cpu", "cuda", "cann", "neutral", "standard", "qnn")
KV_LAYOUTS = ("auto", "concat", "shared")  # auto: shared where the fused kernel runs
QUANT_SCHEMES = ("w8a8", "w8a16", "w4a16", "w4a8")


def at_least(name: str, value: Any, low: int, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise UsageError(f"{option(name)} must be an integer >= {low}, got {value!r}.")


def _one_of(name: str, value: Any, choices: Sequence[str]) -> None:
    if value not in choices:
        raise UsageError(f"{option(name)} must be one of {', '.join(choices)}, got {value!r}.")


def check_passes(passes: Sequence[str] | None) -> None:
    if passes is None:
        return

    known = all_pass_names()
    unknown = [p for p in passes if p not in known]
    if unknown or not passes:
        raise UsageError(
            f"unknown pass(es) {', '.join(unknown) or '(none given)'} in {option('passes')}; "
            f"choose from {', '.join(known)}."
        )


def check_layout(target: str, kv_layout: str, fuse: bool, passes: Sequence[str] | None) -> None:
    _one_of("target", target, TARGETS)
    _one_of("kv_layout", kv_layout, KV_LAYOUTS)
    check_passes(passes)
    if kv_layout != "shared":
        return
    if target not in ("cpu", "cuda"):
        raise UsageError(
            f"{option('kv_layout', 'shared')} needs onnxruntime's GroupQueryAttention "
            f"({option('target')} cpu or cuda), not {option('target', target)}; use "
            f"{option('kv_layout', 'concat')} for {target}."
        )
    if not fuse:
        raise UsageError(
            f"{option('kv_layout', 'shared')} needs the fusion passes; drop "
            f"{option('fuse', False)}, or use {option('kv_layout', 'concat')}."
        )
    if passes is not None and "fuse_attention" not in passes:
        raise UsageError(
            f"{option('kv_layout', 'shared')} needs fuse_attention in {option('passes')} "
            "(attention becomes the in-place GroupQueryAttention)."
        )


def check_export(
    model: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    tokenizer: str | os.PathLike[str] | None = None,
    target: str = "cpu",
    fuse: bool = True,
    passes: Sequence[str] | None = None,
    layers: int | None = None,
    kv_layout: str = "auto",
    max_length: int | None = None,
    tree_mask: bool = False,
    quant: str | None = None,
    dtype: str = "fp32",
) -> None:
    """Everything about an export that can be known without loading the weights."""
    check_layout(target, kv_layout, fuse, passes)

    resolve_dtype(dtype, target, quant)
    at_least("layers", layers, 1, allow_none=True)
    at_least("max_length", max_length, 1, allow_none=True)
    if max_length is not None and kv_layout == "concat":
        raise UsageError(
            f"{option('max_length')} sizes the shared KV buffer; add "
            f"{option('kv_layout', 'shared')} or drop {option('max_length')}."
        )
    # (on the shared layout the fused attention takes the tree as its bias)
    if tree_mask and kv_layout == "concat" and passes is not None and "fuse_attention" in passes:
        raise UsageError(
            f"{option('tree_mask')} cannot run fuse_attention (the fused op would ignore the "
            f"tree); drop it from {option('passes')}."
        )
    if quant is not None:
        _one_of("quant", quant, QUANT_SCHEMES)
        if target == "qnn" and quant not in ("w8a16", "w4a16"):  # exporter/qnn_quant.py
            raise UsageError(
                f"{option('target', 'qnn')} quantizes as w8a16 or w4a16 (QDQ, uint16 "
                f"activations for the NPU), not {option('quant', quant)}."
            )
    src = Path(model).expanduser()
    if tokenizer is not None:
        tok = Path(tokenizer).expanduser()
        if not tok.is_file():
            raise InputError(
                f"{option('tokenizer')} {tokenizer} is not a file; pass the llama2c tokenizer .bin."
            )
        if not (src.is_file() and src.suffix == ".bin"):
            raise UsageError(
                f"{option('tokenizer')} is for llama2c checkpoints (.bin); a Hugging Face model "
                "brings its own tokenizer files. Drop it."
            )
    check_artifact_out(out, [model, tokenizer])
    numbers = model_numbers(src)
    if numbers is not None:
        _check_against_model(numbers, layers, kv_layout, max_length)


def model_numbers(src: Path) -> dict[str, Any] | None:
    """Layers, context and KV head dims from config.json or a llama2c header (no weights), or
    None when the source is of a kind read only by the exporter (hub id, other formats)."""
    try:
        if src.is_file() and src.suffix == ".bin":
            return _llama2c_numbers(src)
        cfg_path = src / "config.json"
        if src.is_dir() and cfg_path.is_file():
            return _hf_numbers(json.loads(cfg_path.read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError, struct.error):
        return None  # the exporter reports an unreadable source with its own message
    return None


def _hf_numbers(cfg: dict[str, Any]) -> dict[str, Any] | None:
    text = cfg.get("text_config")
    if isinstance(text, dict):
        cfg = {**cfg, **text}
    layers = cfg.get("num_hidden_layers", cfg.get("n_layer"))
    heads = cfg.get("num_attention_heads", cfg.get("n_head"))
    hidden = cfg.get("hidden_size", cfg.get("n_embd"))
    context = cfg.get("max_position_embeddings", cfg.get("n_positions"))
    if not (isinstance(layers, int) and isinstance(heads, int) and isinstance(hidden, int)):
        return None
    if cfg.get("kv_lora_rank"):  # MLA: keys carry a rope part, values do not
        k = int(cfg.get("qk_nope_head_dim", 0)) + int(cfg.get("qk_rope_head_dim", 0))
        v = int(cfg.get("v_head_dim", 0))
    else:
        k = v = int(cfg.get("head_dim") or hidden // heads)
    return {"layers": layers, "context": context, "kv_dims": (k, v)}


def _llama2c_numbers(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        dim, _hidden, layers, heads, _kv, _vocab, seq_len = struct.unpack("7i", f.read(28))
    head = dim // heads
    return {"layers": layers, "context": seq_len, "kv_dims": (head, head)}


def _check_against_model(
    numbers: dict[str, Any], layers: int | None, kv_layout: str, max_length: int | None
) -> None:
    total = numbers["layers"]
    if layers is not None and layers > total:
        raise UsageError(
            f"{option('layers', layers)} is more than the model's {total} layers; use 1..{total}."
        )
    if kv_layout not in ("shared", "auto"):
        return
    k, v = numbers["kv_dims"]
    if (k != v or k % 16) and kv_layout == "auto":
        return  # auto keeps concat for head dims the fused kernel refuses
    if k != v or k % 16:
        raise UsageError(
            f"{option('kv_layout', 'shared')} runs attention as onnxruntime's "
            f"GroupQueryAttention, which needs equal key/value head dims that are a multiple of "
            f"16; this model has (key, value) head dims ({k}, {v}). Use "
            f"{option('kv_layout', 'concat')} for this model."
        )
    context = numbers.get("context")
    if max_length is not None and isinstance(context, int) and max_length > context:
        raise UsageError(
            f"{option('max_length', max_length)} is longer than the model's context ({context}); "
            f"use 1..{context}."
        )


def check_quantize(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    scheme: str = "w4a16",
    group_size: int | None = None,
    algo: str = "default",
    calib_files: Sequence[str | os.PathLike[str]] = (),
    mixed_precision: str = "off",
    calib_docs: int = 300,
    lm_head_bits: int | str | None = None,
    embedding_bits: int | None = None,
    form: str = "matmulnbits",
    kv_cache: str = "float",
    kv_clip: str = "absmax",
    symmetric: bool = False,
    float_zero: bool = False,
    kv_granularity: str | None = None,
    kv_float_layers: Sequence[int] | str = (),
    bits_per_weight: float | None = None,
    mixture: str | None = None,
    exact_speculation: bool = False,
    **_: Any,
) -> None:
    """The quantizer's own option checks, plus inputs and output, before calibration starts."""

    at_least("calib_docs", calib_docs, 1)
    if embedding_bits not in (None, 0, 4, 8):
        raise UsageError(f"{option('embedding_bits')} must be 0, 4 or 8, got {embedding_bits!r}.")
    resolved_group = (
        group_size
        if group_size is not None
        else checks.default_group_size(scheme, exact_speculation)
    )
    resolved_algo = algo
    if algo == "default" and not calib_files and scheme != "w8a8" and mixed_precision == "off":
        resolved_algo = "hqq"
    if symmetric and (resolved_algo in ("ort-default", "ort-hqq") or float_zero):
        raise UsageError(
            f"{option('symmetric')} needs --algo rtn, hqq, clip, gptq or default and no "
            f"{option('float_zero')} ({resolved_algo if not float_zero else 'float zero points'} "
            "fits its own zero points)."
        )
    if float_zero and scheme not in ("w4a16", "w4a8"):
        raise UsageError(
            f"{option('float_zero')} keeps 4-bit zero points in float; {scheme} has no 4-bit "
            f"weights. Pass {option('scheme', 'w4a16')} or w4a8, or drop it."
        )
    try:
        checks.check_kv_options(
            scheme, resolved_algo, kv_cache, kv_clip, calib_files, kv_granularity, kv_float_layers
        )
        checks.check_weight_options(
            scheme, resolved_algo, resolved_group, calib_files, mixed_precision, form
        )
        check_head_bits(scheme, resolved_algo, lm_head_bits)
        checks.check_budget_options(
            scheme,
            algo,
            form,
            mixed_precision,
            lm_head_bits,
            embedding_bits,
            bits_per_weight,
            mixture,
        )
    except SpecportError as e:  # argument-only checks: a usage error
        raise UsageError(str(e)) from None
    for f in calib_files:
        if not Path(f).is_file():
            raise InputError(
                f"calibration text {f} is not a file; pass {option('calib_files')} with text "
                "files (documents separated by blank lines)."
            )
    manifest = read_manifest(src, check_hashes=False)  # the quantizer checks hashes itself
    refuse_hard_linked_weights(weight_files(Path(src), manifest))
    try:
        checks.check_kv_layout(Path(src), manifest, kv_cache, kv_granularity)
        checks.check_chain(Path(src), out, manifest, scheme, algo, kv_cache)
    except SpecportError as e:  # the input cannot take these options
        raise UsageError(str(e)) from None
    check_artifact_out(out, [src, *calib_files])


def check_optimize(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    target: str,
    passes: Sequence[str] | None,
    options: dict[str, Any],
) -> Any:
    """Options, the input graph (see `specport.core.onnx_file`) and the output; returns the proto."""

    check_layout(target, options.get("kv_layout", "concat"), True, passes)
    at_least("sliding_window", options.get("sliding_window"), 1, allow_none=True)
    at_least("max_length", options.get("max_length"), 1, allow_none=True)
    if options.get("max_length") is not None and options.get("kv_layout") != "shared":
        raise UsageError(
            f"{option('max_length')} sizes the shared KV buffer; add "
            f"{option('kv_layout', 'shared')} or drop {option('max_length')}."
        )
    proto = check_onnx_input(src)
    inputs: list[Any] = [src]
    inputs += sorted(
        {
            str(Path(src).parent / e.value)
            for t in proto.graph.initializer
            for e in t.external_data
            if e.key == "location"
        }
    )
    refuse_hard_linked_weights([Path(p) for p in inputs[1:]])
    check_onnx_out(out, inputs)
    return proto


def check_train_mtp(
    artifact: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    num_heads: int = 3,
    data: str | os.PathLike[str] | None = None,
    steps: int = 600,
    num_sequences: int = 768,
) -> None:

    at_least("num_heads", num_heads, 1)
    at_least("steps", steps, 1)
    at_least("num_sequences", num_sequences, 16)
    manifest = read_manifest(artifact)
    refuse_hard_linked_weights(weight_files(Path(artifact), manifest))
    check_artifact_out(out, [artifact, data])
    if not manifest.extra.get("mtp_source_weights"):
        if data is None:
            raise UsageError(
                f"{option('data')} is required to train MTP heads (a text file, documents "
                "separated by blank lines)."
            )
        if not Path(data).is_file():
            raise InputError(f"{option('data')} {data} is not a file; pass a text file.")
        if manifest.tokenizer.get("kind") in (None, "none"):
            raise InputError(
                f"{artifact} has no tokenizer; training MTP heads reads {option('data')} with it."
            )
