"""`specport eval ppl ARTIFACT --text FILE` and `specport eval compare A B --text FILE`."""

from __future__ import annotations

import argparse
import sys

from specport.cli import emit_json


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
            q.add_argument("other", help="second artifact, compared against the first")
        q.add_argument(
            "--text", required=True, help="text file, documents separated by blank lines"
        )
        q.add_argument("--max-docs", type=int, help="use at most N documents")
        q.add_argument(
            "--last", action="store_true", help="take the last N documents instead of the first"
        )
        q.add_argument(
            "--context",
            type=int,
            help="truncate documents to this many tokens (default: model context)",
        )
        q.add_argument(
            "--chunk",
            type=int,
            help="feed N tokens per run, carrying the KV cache (scores what the model reads "
            "back from its cache, e.g. --kv-cache int8); default: one pass per document",
        )
        q.add_argument("--json", action="store_true", help="print one JSON object on stdout")
        q.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from specport.progress import enabled
    from specport.runtime.eval import compare, perplexity

    show = enabled(None) and not args.json

    def progress(i: int, n: int) -> None:
        if show and (i == n or i % 50 == 0):
            print(f"\rscoring: {i}/{n}", end="\n" if i == n else "", file=sys.stderr, flush=True)

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
        if args.json:
            emit_json(r)
        else:
            print(
                f"perplexity {r['ppl']:.4f} (nll {r['nll']:.4f}) on {r['tokens']} tokens, {r['docs']} docs"
            )
        return 0
    r = compare(
        args.artifact,
        args.other,
        args.text,
        args.max_docs,
        args.context,
        last=args.last,
        chunk=args.chunk,
    )
    if args.json:
        emit_json(r)
    else:
        print(
            f"top-1 agreement {100 * r['top1_agreement']:.2f}%  KL {r['kl']:.5f} nats/token  "
            f"ppl {r['ppl_a']:.4f} -> {r['ppl_b']:.4f} ({r['positions']} positions, {r['docs']} docs)"
        )
    return 0
