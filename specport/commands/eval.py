"""`specport eval ppl ARTIFACT --text FILE` and `specport eval compare A B [C ...] --text FILE`.

`compare` scores every further artifact against the first (top-1 agreement, KL, both
perplexities); `--plot FILE` draws perplexity against bits per weight, the usual picture of a
quantization trade-off.
"""

from __future__ import annotations

import argparse
from typing import Any

from specport.cli import emit_json
from specport.commands._args import POSITIVE, int_at_least


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="perplexity of an artifact, or agreement of two artifacts")
    ev = p.add_subparsers(dest="eval_command", metavar="{ppl,compare}")
    ev.required = True
    for name in ("ppl", "compare"):
        q = ev.add_parser(
            name, help="perplexity on text" if name == "ppl" else "top-1 agreement and KL of B vs A"
        )
        q.add_argument("artifact", help="artifact directory (or .onnx beside a tokenizer.json)")
        if name == "compare":
            q.add_argument(
                "other",
                nargs="+",
                help="artifact(s) compared against the first, e.g. its quantizations",
            )
        q.add_argument(
            "--text", required=True, help="text file, documents separated by blank lines"
        )
        q.add_argument("--max-docs", type=POSITIVE, help="use at most N documents")
        q.add_argument(
            "--last", action="store_true", help="take the last N documents instead of the first"
        )
        q.add_argument(
            "--context",
            type=int_at_least(2),
            help="truncate documents to this many tokens (default: model context)",
        )
        q.add_argument(
            "--chunk",
            type=POSITIVE,
            help="feed N tokens per run, carrying the KV cache (scores what the model reads "
            "back from its cache, e.g. --kv-cache int8); default: one pass per document",
        )
        q.add_argument(
            "--record",
            action="store_true",
            help="write the result into the artifact's specport.json and model card "
            + (
                "(perplexity, text name and sha256; a quantized artifact's float32 reference "
                "when quantize carried one)"
                if name == "ppl"
                else "(on B: its perplexity, with A's as the reference and the delta)"
            )
            + "; off by default: evaluation leaves the artifact unchanged",
        )
        if name == "compare":
            q.add_argument(
                "--plot",
                metavar="FILE",
                help="draw perplexity against bits per weight (each artifact's quantization "
                "scheme, or its float dtype) into FILE (.png or .svg)",
            )
        q.add_argument("--json", action="store_true", help="print one JSON object on stdout")
        q.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from specport.core.progress import stage_callback
    from specport.runtime.eval import compare_many, perplexity

    report = stage_callback()

    def progress(i: int, n: int) -> None:
        report("scoring documents", i, n)

    from specport.artifact.eval_record import (
        artifact_label,
        options_key,
        record_eval,
        require_artifact_dir,
    )

    options = options_key(args.max_docs, args.last, args.context, args.chunk)
    if args.record:  # fail before the (long) scoring, not after
        for target in args.other if args.eval_command == "compare" else [args.artifact]:
            require_artifact_dir(target)
    if args.eval_command == "ppl":
        r = perplexity(
            args.artifact,
            args.text,
            args.max_docs,
            args.context,
            last=args.last,
            progress=progress,
            chunk=args.chunk,
        )
        if args.record:
            r["recorded"] = record_eval(args.artifact, r, args.text, options)
        size = _size(args.artifact)
        if size is not None:
            r["bits_per_weight"] = size["bits_per_weight"]
            r["size"] = size
        if args.json:
            emit_json(r)
        else:
            print(
                f"perplexity {r['ppl']:.4f} (nll {r['nll']:.4f}) on {r['tokens']} tokens, {r['docs']} docs"
                + (f"; {size['bits_per_weight']:.2f} bits per weight" if size else "")
            )
            if args.record:
                _print_recorded(args.artifact, r["recorded"])
        return 0
    plot = None
    if args.plot:  # before the scoring: a bad file name must not cost a run
        from specport.bench.plot import check_plot_path

        plot = check_plot_path(args.plot)
    others = list(dict.fromkeys(args.other))
    results = []
    scored = compare_many(
        args.artifact,
        others,
        args.text,
        args.max_docs,
        args.context,
        last=args.last,
        chunk=args.chunk,
    )
    for other, r in zip(others, scored):
        r["artifact"], r["other"] = args.artifact, other
        if args.record:
            ref = {
                "ppl": r["ppl_a"],
                "label": artifact_label(args.artifact),
                "via": "eval compare",
            }
            own = {"ppl": r["ppl_b"], "tokens": r["positions"] - r["docs"], "docs": r["docs"]}
            r["recorded"] = record_eval(other, own, args.text, options, reference=ref)
        results.append(r)
        if not args.json:
            print(
                f"{other}: top-1 agreement {100 * r['top1_agreement']:.2f}%  KL {r['kl']:.5f} "
                f"nats/token  ppl {r['ppl_a']:.4f} -> {r['ppl_b']:.4f} ({r['positions']} "
                f"positions, {r['docs']} docs)"
            )
            if args.record:
                _print_recorded(other, r["recorded"])
    if plot is not None:
        from specport.bench.plot import quality_chart

        points = [_point(args.artifact, results[0]["ppl_a"])]
        points += [_point(r["other"], r["ppl_b"]) for r in results]
        quality_chart(points, plot, f"{args.text} ({results[0]['positions']} positions)")
        if not args.json:
            print(f"chart: {plot}")
    if args.json:
        emit_json(results[0] if len(results) == 1 else {"compared": results})
    return 0


def _point(artifact: str, ppl: float) -> dict[str, Any]:
    """A chart point: the artifact's name, its weights' bits and its perplexity."""
    from pathlib import Path

    bits, scheme = weight_bits(artifact)
    return {"label": f"{Path(artifact).name} ({scheme})", "bits": bits, "ppl": ppl}


def _size(artifact: str) -> dict[str, Any] | None:
    """The artifact's stored bits per weight (core/weight_size.py); None for a bare .onnx."""
    from pathlib import Path

    from specport.artifact.manifest import read_manifest
    from specport.core.errors import ArtifactError
    from specport.core.weight_size import artifact_weight_size

    if not Path(artifact).is_dir():
        return None
    try:
        manifest = read_manifest(artifact, check_hashes=False)
    except ArtifactError:
        return None
    return artifact_weight_size(artifact, manifest).record()


def weight_bits(artifact: str) -> tuple[float, str]:
    """Bits per weight as stored (every weight, scale and zero-point byte over the parameter
    count, as llama.cpp reports a file), with the recipe's name to show; a bare .onnx counts
    its own graph."""
    from specport.artifact.manifest import read_manifest
    from specport.core.errors import ArtifactError
    from specport.core.weight_size import model_weight_size

    try:
        manifest = read_manifest(artifact, check_hashes=False)
    except ArtifactError:  # a bare .onnx beside its tokenizer: no manifest to read a recipe from
        return round(model_weight_size(artifact).bits_per_weight, 2), "onnx"
    size = _size(artifact)
    bits = round(size["bits_per_weight"], 2) if size else 32.0
    scheme = str((manifest.quant or {}).get("scheme") or "none")
    if scheme != "none":
        algo = (manifest.quant or {}).get("algorithm")
        return bits, f"{scheme} {algo}" if algo else scheme
    return bits, str(manifest.dtype)


def _print_recorded(artifact: str, rec: dict[str, Any]) -> None:
    ref = rec.get("reference")
    extra = f" (reference {ref['ppl']:.4f}, delta {rec['ppl_delta']:+.4f})" if ref else ""
    print(f"recorded perplexity {rec['ppl']:.4f}{extra} in {artifact}/specport.json and its card")
