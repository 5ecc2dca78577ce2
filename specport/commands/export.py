"""`specport export MODEL --out DIR`."""

from __future__ import annotations

import argparse

import specport
from specport.cli import emit_json
from specport.commands._args import POSITIVE


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export", help="export a Hugging Face model, GGUF file or llama2c checkpoint to an artifact"
    )
    p.add_argument(
        "model", help="Hugging Face model directory, cached hub id, GGUF file, or llama2c .bin"
    )
    p.add_argument(
        "--out",
        required=True,
        help="artifact directory to write: new, empty, or an artifact (replaced atomically)",
    )
    p.add_argument("--tokenizer", help="llama2c tokenizer .bin (for a llama2c checkpoint)")
    p.add_argument(
        "--target",
        default="cpu",
        choices=["cpu", "cuda", "cann", "neutral", "standard", "qnn"],
        help="pass pipeline target (default cpu). standard: ai.onnx ops only, any onnxruntime "
        "provider; qnn: Qualcomm NPUs (static prefill/decode graphs; --soc compiles them)",
    )
    p.add_argument(
        "--soc",
        type=POSITIVE,
        help="(--target qnn) Snapdragon SoC model to compile the QNN context binary for, e.g. "
        "60 = X Elite, 69 = 8 Gen 3 (needs onnxruntime-qnn; without it the float graphs ship "
        "and compile when loaded)",
    )
    p.add_argument(
        "--context-length",
        type=POSITIVE,
        help="(--target qnn) fixed context of the static graphs (default min(model's, 1024))",
    )
    p.add_argument(
        "--prefill-chunk",
        type=POSITIVE,
        help="(--target qnn) new tokens per prefill graph run (default 64)",
    )
    p.add_argument(
        "--no-fuse", action="store_true", help="skip fusion passes (plain exported graph)"
    )
    p.add_argument("--passes", help="comma-separated pass names, overriding the target's pipeline")
    p.add_argument(
        "--layers", type=POSITIVE, help="keep only the first N decoder layers (self-draft model)"
    )
    p.add_argument(
        "--kv-layout",
        default="auto",
        choices=["auto", "concat", "shared"],
        help="KV cache contract: auto (default: shared wherever onnxruntime's fused attention "
        "runs the model, else concat; inspect shows why), shared (cpu/cuda: one in-place "
        "buffer per layer, logits_index/next_token; the fast path) or concat (past in, present "
        "out: any target, a plain InferenceSession)",
    )
    p.add_argument(
        "--max-length",
        type=POSITIVE,
        help="KV buffer limit for --kv-layout shared (default min(context length, 4096))",
    )
    p.add_argument(
        "--tree-mask",
        action="store_true",
        help="add a tree_mask [B,S,S] input so speculative decoding can verify a token tree "
        "in one run (shared layout: as the fused attention's bias; concat: attention "
        "stays unfused)",
    )
    p.add_argument(
        "--quant",
        choices=["w8a8", "w8a16", "w4a16", "w4a8"],
        help="quantize after export (default recipe; `specport quantize` has every option)",
    )
    p.add_argument(
        "--quant-algo",
        choices=["hqq", "rtn"],
        default="hqq",
        help="algorithm of --quant w4a8/w4a16/w8a16, applied while the weights stream from the "
        "checkpoint (default hqq; rtn is faster on very large models)",
    )
    p.add_argument(
        "--dtype",
        choices=["fp32", "fp16", "bf16"],
        default="fp32",
        help="float type of weights, activations and KV cache (logits stay fp32; default "
        "fp32). fp16 halves the weights (cpu: attention and KV stay fp32; measured 0.8-1.2x "
        "decode, 0.9x prefill, 0.58x RSS vs fp32 on SmolLM2); bf16 needs --target cuda",
    )
    p.add_argument(
        "--keep-gguf-quant",
        action="store_true",
        help="(GGUF source) MatMul weights keep the file's own quantized blocks as MatMulNBits "
        "instead of float32 (Q4_0/Q8_0/Q5_0/Q6_K exactly, Q4_1/Q4_K to ~1 ulp)",
    )
    p.add_argument(
        "--skip-verify", action="store_true", help="do not compare against PyTorch after export"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from specport.core.errors import UsageError

    passes = (
        [p.strip() for p in args.passes.split(",") if p.strip()]
        if args.passes is not None
        else None
    )
    if args.passes is not None and args.no_fuse:
        raise UsageError("--no-fuse and --passes exclude each other; drop one of them.")
    if args.keep_gguf_quant:  # checked before the slow export
        if args.quant:
            raise UsageError("use either --keep-gguf-quant or --quant, not both.")
        if args.dtype != "fp32":
            raise UsageError("--keep-gguf-quant keeps quantized weights; drop --dtype.")
        if not str(args.model).lower().endswith(".gguf") or args.kv_layout != "concat":
            raise UsageError(
                "--keep-gguf-quant needs a GGUF source file (model.gguf) and the concat KV layout."
            )
    manifest = specport.export(
        args.model,
        args.out,
        tokenizer=args.tokenizer,
        target=args.target,
        fuse=not args.no_fuse,
        passes=passes,
        skip_verify=args.skip_verify,
        layers=args.layers,
        kv_layout=args.kv_layout,
        max_length=args.max_length,
        tree_mask=args.tree_mask,
        quant=args.quant,
        quant_algo=args.quant_algo,
        dtype=args.dtype,
        **_static_options(args),
    )
    if args.keep_gguf_quant:
        from specport.exporter.keep_gguf import keep_gguf_quant_artifact

        manifest = keep_gguf_quant_artifact(args.out, args.out, args.model)
    summary = {
        "artifact": str(args.out),
        "architecture": manifest.architecture,
        "target": manifest.target,
        "kv_layout": manifest.kv.layout,
        "dtype": manifest.dtype,
        "verify": {
            k: manifest.verify.get(k)
            for k in ("ok", "max_abs_logits", "max_abs_kv", "skipped")
            if k in manifest.verify
        },
        "passes": [p.get("name") for p in manifest.passes],
        "seconds": manifest.extra.get("export", {}).get("seconds"),
    }
    if args.json:
        emit_json(summary)
    else:
        v = manifest.verify
        err = (
            "skipped"
            if v.get("skipped")
            else f"max |logits diff| vs PyTorch {v.get('max_abs_logits', float('nan')):.2e}"
        )
        print(f"exported {manifest.architecture} to {args.out} ({err})")
    return 0


def _static_options(args: argparse.Namespace) -> dict[str, int]:
    """--soc / --context-length / --prefill-chunk, passed only when given (target qnn)."""
    names = {"soc": args.soc, "context_length": args.context_length}
    names["prefill_chunk"] = args.prefill_chunk
    return {k: v for k, v in names.items() if v is not None}
