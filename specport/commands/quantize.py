"""`specport quantize ARTIFACT --out DIR --scheme ...`: a quantized copy of an artifact."""

from __future__ import annotations

import argparse
from typing import Any

import specport
from specport.cli import emit_json
from specport.commands._args import POSITIVE


def _head_bits(value: str) -> int | str:
    return value if value == "auto" else int(value)


def _frequent_rows(value: str) -> int | None:
    if value == "auto":
        return None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a row count or auto, got {value!r}") from None


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "quantize", help="quantize an artifact (W8A8, W8A16, W4A16, W4A8; int8 KV cache)"
    )
    p.add_argument("artifact", help="source artifact directory")
    p.add_argument(
        "--out",
        required=True,
        help="output artifact directory (new, empty, or an artifact; never the source)",
    )
    p.add_argument(
        "--scheme",
        choices=["w8a8", "w8a16", "w4a16", "w4a8", "none"],
        help="weight scheme; none keeps float weights (default none with --kv-cache int8)",
    )
    p.add_argument(
        "--group-size",
        type=int,
        default=None,
        choices=[16, 32, 64, 128, 256],
        help="block size along K (default 32; 64 for w8a8); with int8 activations, blocks above "
        "32 (4-bit) or 64 (8-bit) make speculation inexact",
    )
    p.add_argument(
        "--algo",
        default="default",
        choices=["rtn", "hqq", "gptq", "clip", "default", "ort-default", "ort-hqq"],
        help="default: GPTQ (act order) + clipping + scale refit with --calib, else hqq; "
        "ort-*: onnxruntime's own MatMulNBitsQuantizer as a baseline",
    )
    p.add_argument(
        "--calib",
        nargs="+",
        default=[],
        metavar="FILE",
        help="calibration text (docs separated by blank lines); w8a8 without it: "
        "round-to-nearest, no SmoothQuant",
    )
    p.add_argument(
        "--calib-docs",
        type=POSITIVE,
        default=300,
        help="documents used for calibration (default 300)",
    )
    p.add_argument("--mixed-precision", default="off", choices=["auto", "off"])
    p.add_argument(
        "--bits-per-weight",
        type=float,
        default=None,
        metavar="B",
        help="size budget for the whole file (codes, scales, zero points, embedding table and "
        "LM head over the parameter count): every tensor's width (4/8 bits) and block size "
        "(32/64/128) is chosen by measured output error to fit it (default scheme w4a8)",
    )
    p.add_argument(
        "--mixture",
        default=None,
        choices=["q4_0", "q4_k_m", "q5_k_m", "q6_k", "q8_0"],
        help="a named budget: the nominal bits per weight of llama.cpp's type "
        "(q4_0 4.5, q4_k_m 4.85, q5_k_m 5.7, q6_k 6.56, q8_0 8.5)",
    )
    p.add_argument(
        "--lm-head-bits",
        type=_head_bits,
        default=None,
        choices=[0, 4, 8, "auto"],
        help="LM head precision; 0 keeps it in float; auto (w4a8, w4a16) picks 4 bits where the "
        "head is a large share of bytes per token and its measured logit change is small "
        "(default: auto for w4a8, 8 for w8a8, float otherwise)",
    )
    p.add_argument(
        "--float-zero",
        action="store_true",
        help="keep 4-bit zero points in float32 (llama.cpp's Q4_1 grid; 6.0 bits per weight at "
        "block 32, stored as block offsets; with --bits-per-weight, offered per weight)",
    )
    p.add_argument(
        "--frequent-head-rows",
        type=_frequent_rows,
        default=None,
        metavar="N|auto",
        help="with --scheme w4a8: split the tied LM head and embedding table by vocabulary "
        "and keep the first N ids (byte-level BPE's most frequent tokens) at 8 bits; with "
        "--bits-per-weight the rest is planned by the budget, without one it is 4-bit (a "
        "faster head than the default's 8-bit one); auto (default): the budget chooses N by "
        "token-frequency-weighted error, no split without a budget (0: keep the head whole)",
    )
    p.add_argument(
        "--exact-speculation",
        action="store_true",
        help="w4a8/w8a8: make greedy speculation give plain greedy's tokens exactly (every "
        "attention run gets a second query row; plain decoding pays it: SmolLM2 W8A8 about 1.15x "
        "CPU per token); w4a8 then takes the largest 4-bit block up to 32 whose int8 kernel is "
        "row-invariant on this CPU unless --group-size is given (32 on AVX-512 VNNI, 16 on "
        "AVX2; --group-size 16 makes a file exact on both)",
    )
    p.add_argument(
        "--keep-kv-values",
        action="store_true",
        help="w8a8: fold no SmoothQuant scale into the value projection, so the KV cache holds "
        "the source model's values and the file can draft in its float target's cache "
        "(`--speculative draft --draft FILE`); no run-time cost",
    )
    p.add_argument(
        "--symmetric",
        action="store_true",
        help="symmetric 4-bit weights (no zero points): onnxruntime's int8-activation CPU kernel "
        "runs them faster (AVX2: 1.01-1.06x decode, 1.1x with --lm-head-bits 4; AVX-512: 1.06x), "
        "at a quality cost that "
        "depends on the model: check it with `eval compare` (rtn, clip, gptq, default; hqq, the "
        "default without --calib, searches each block's scale instead of its zero point)",
    )
    p.add_argument(
        "--embedding-bits",
        type=int,
        default=None,
        choices=[0, 4, 8],
        help="GatherBlockQuantized embedding (0: float; default 8 for w4a16/w4a8, else 0)",
    )
    p.add_argument(
        "--form",
        default="matmulnbits",
        choices=["matmulnbits", "qdq", "dynamic", "npu", "ascend"],
        help="graph form: matmulnbits (default), qdq (weight-only: blocked-int4 QDQ; w8a8: "
        "static QDQ), dynamic (w8a8: DynamicQuantizeMatMul), npu (w8a16/w4a16: QDQ with uint16 "
        "activations calibrated on --calib or the built-in text, symmetric int8 per-channel or "
        "int4 blocked weights: the NPU format, e.g. Qualcomm HTP), ascend (w8a8 in Ascend's "
        "layout: int8 symmetric per-channel weights, int8 activations with a per-tensor "
        "offset; the default w8a8 form of a --target cann artifact)",
    )
    p.add_argument(
        "--kv-cache",
        default="float",
        choices=["float", "int8"],
        help="int8: int8 KV cache with scales calibrated on --calib (either KV layout)",
    )
    p.add_argument(
        "--kv-granularity",
        default=None,
        choices=["per_channel", "per_kv_head", "per_tensor"],
        help="int8 KV scales: per_channel (default on the shared layout), per_kv_head (the "
        "concat layout's only one), per_tensor",
    )
    p.add_argument(
        "--kv-float-layers",
        default=None,
        metavar="I,J,...",
        help="with --kv-cache int8 on the shared layout: keep these layers' KV cache float32 "
        "(comma-separated layer indices, or auto: the fewest layers that keep teacher-forced "
        "chat agreement at 99%%, measured on the calibration text)",
    )
    p.add_argument(
        "--kv-clip",
        default="absmax",
        choices=["absmax", "mse", "p99.9", "p99.99"],
        help="clipping range of the int8 KV scales (default absmax)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from specport.core.errors import UsageError
    from specport.core.progress import stage_callback

    budget = args.bits_per_weight is not None or args.mixture is not None
    if args.scheme is None and budget:
        args.scheme = "w4a8"
    if args.scheme is None and args.kv_cache == "float":
        raise UsageError("nothing to do: pass --scheme and/or --kv-cache int8.")
    m = specport.quantize(
        args.artifact,
        args.out,
        scheme=args.scheme or "none",
        group_size=args.group_size,
        algo=args.algo,
        calib_files=args.calib,
        mixed_precision=args.mixed_precision,
        progress=stage_callback(),
        calib_docs=args.calib_docs,
        lm_head_bits=args.lm_head_bits,
        float_zero=args.float_zero,
        symmetric=args.symmetric,
        exact_speculation=args.exact_speculation,
        keep_kv_values=args.keep_kv_values,
        frequent_head_rows=args.frequent_head_rows,
        embedding_bits=args.embedding_bits,
        form=args.form,
        kv_cache=args.kv_cache,
        kv_clip=args.kv_clip,
        kv_granularity=args.kv_granularity,
        kv_float_layers=_layer_list(args.kv_float_layers),
        **({"bits_per_weight": args.bits_per_weight, "mixture": args.mixture} if budget else {}),
    )
    q: dict[str, Any] = dict(m.quant or {})
    bits = list((q.get("layers") or {}).values())
    summary = {
        "out": args.out,
        "scheme": q.get("scheme"),
        "algorithm": q.get("algorithm"),
        "group_size": q.get("group_size"),
        "layers": len(bits),
        "layers_by_bits": {str(b): bits.count(b) for b in sorted(set(bits), key=str)},
        "ort_cpu": q.get("ort_cpu"),
        "calibration": q.get("calibration"),
        "lm_head": q.get("lm_head") or {"bits": q.get("lm_head_bits")},
        "kv_cache": {k: v for k, v in (q.get("kv_cache") or {}).items() if k != "scales"} or None,
        "bits_per_weight": (q.get("size") or {}).get("bits_per_weight"),
        "budget": {k: v for k, v in (q.get("budget") or {}).items() if k != "tensors"} or None,
    }
    if args.json:
        emit_json(summary)
        return 0
    recipe = (
        "float weights"
        if summary["scheme"] == "none"
        else f"{summary['scheme']}, {summary['algorithm']}, group {summary['group_size']}"
    )
    print(f"{args.artifact} -> {args.out} ({recipe})")
    if summary["scheme"] != "none":
        counts = ", ".join(f"{n} at {b}" for b, n in summary["layers_by_bits"].items())
        print(f"  layers: {summary['layers']} matmuls ({counts} bits)")
    if summary["bits_per_weight"] is not None:
        plan = summary["budget"]
        within = f" (budget {plan['target_bits_per_weight']}: {plan['summary']})" if plan else ""
        print(f"  size: {summary['bits_per_weight']:.2f} bits per weight{within}")
    head = summary["lm_head"]
    if summary["scheme"] != "none" and head.get("bits") is not None:
        reason = f" ({head['choice']}: {head['reason']})" if head.get("choice") else ""
        print(f"  LM head: {head['bits'] or 'float'}{' bits' if head['bits'] else ''}{reason}")
    if summary["kv_cache"]:
        kv = summary["kv_cache"]
        layers = m.kv.dtypes()
        where = (
            f", int8 in {layers.count('int8')} of {len(layers)} layers" if m.kv.layer_dtypes else ""
        )
        print(f"  KV cache: {kv['dtype']} ({kv.get('granularity')}, {kv['clip']} scales{where})")
        check = kv.get("chat_check")
        if check:
            flag = "" if check["ok"] else "  WARNING: below the threshold, chat answers may change"
            print(
                f"  chat check: top-1 agreement {100 * check['agreement']:.2f}% over "
                f"{check['positions']} positions (KL {check['kl']:.2e}){flag}"
            )
    kernels = (summary["ort_cpu"] or {}).get("kernels")
    if kernels:  # none for a KV-only quantize: its weights stay float
        names = ", ".join(f"{n} {op.rsplit('.', 1)[-1]}" for op, n in kernels.items())
        print(f"  onnxruntime CPU kernels: {names}")
    return 0


def _layer_list(text: str | None) -> list[int] | str:
    """`--kv-float-layers 4,18,22` -> [4, 18, 22]."""
    from specport.core.errors import UsageError

    if not text:
        return []
    if text == "auto":
        return "auto"
    try:
        return sorted({int(t) for t in text.split(",") if t.strip()})
    except ValueError:
        raise UsageError(
            f"--kv-float-layers takes comma-separated layer indices like 4,18,22, not {text!r}"
        ) from None
