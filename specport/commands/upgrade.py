"""`specport upgrade ARTIFACT`: update an artifact from an older specport in place (see
`specport.upgrade`); loading such an artifact names this command."""

from __future__ import annotations

import argparse

from specport.cli import emit_json


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("upgrade", help="update an artifact made by an older specport, in place")
    p.add_argument("artifact", help="artifact directory written by specport")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from specport.upgrade import upgrade  # torch-free, but onnx_ir: keep `--help` fast

    done = upgrade(args.artifact)
    if args.json:
        emit_json({"artifact": str(args.artifact), "upgraded": done})
    else:
        print(f"{args.artifact}: " + ("; ".join(done) if done else "already up to date"))
    return 0
