"""`specport train-mtp ARTIFACT --heads K --data FILE --out DIR`: add MTP heads to an artifact.

Trains K DeepSeek-V3-style MTP heads by self-distillation against the frozen base model (or
takes a DeepSeek-V3 checkpoint's own MTP layers) and writes a new artifact whose graph verifies
drafts and proposes the next ones in one run; use it with `specport generate DIR
--speculative mtp`.
"""

from __future__ import annotations

import argparse

from specport.cli import emit_json


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train-mtp", help="train MTP draft heads and write an MTP artifact")
    p.add_argument("artifact", help="artifact exported by `specport export` (concat KV layout)")
    p.add_argument("--heads", type=int, default=3, help="number of chained MTP heads K (default 3)")
    p.add_argument("--data", help="training text, documents separated by blank lines")
    p.add_argument("--out", required=True, help="artifact directory to write (replaced atomically)")
    p.add_argument("--steps", type=int, default=600, help="optimizer steps (default 600)")
    p.add_argument(
        "--sequences",
        type=int,
        default=768,
        help="self-generated training sequences (default 768)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from specport.errors import InputError
    from specport.exporter.mtp_train import train_mtp

    if args.steps < 1:
        raise InputError(f"--steps must be >= 1, got {args.steps}")
    manifest = train_mtp(
        args.artifact,
        args.out,
        num_heads=args.heads,
        data=args.data,
        steps=args.steps,
        num_sequences=args.sequences,
        progress=None if not args.json else False,
    )
    mtp = manifest.mtp or {}
    training = mtp.get("training", {})
    summary = {"artifact": str(args.out), "heads": mtp.get("heads"), "training": training}
    if args.json:
        emit_json(summary)
    else:
        held = training.get("heldout", {})
        rates = ", ".join(f"{r:.2f}" for r in held.get("acceptance_per_position", []))
        print(
            f"wrote {args.out} with {mtp.get('heads')} MTP heads ({training.get('source')}); "
            f"held-out greedy acceptance per position [{rates}], "
            f"mean accepted length {held.get('mean_accepted_length', 'n/a')}"
        )
    return 0
