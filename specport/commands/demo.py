"""`specport demo`: the whole pipeline offline on a built-in model specport trains itself."""

from __future__ import annotations

import argparse
import sys

from specport.cli import emit_json
from specport.commands._args import POSITIVE


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo", help="train (once, ~2 min), export, verify and run a built-in model, offline"
    )
    p.add_argument("--out", help="where to write the demo artifacts (default: the specport cache)")
    p.add_argument("--max-new-tokens", type=POSITIVE, default=48)
    p.add_argument(
        "--retrain", action="store_true", help="train the demo model again even if cached"
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from specport.samples.demo import print_report, run_demo

    def stream(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    report = run_demo(
        out=args.out,
        max_new_tokens=args.max_new_tokens,
        progress=None,
        stream=None if args.json else stream,
        retrain=args.retrain,
    )
    if args.json:
        emit_json(report)
    else:
        print_report(report)
    return 0
