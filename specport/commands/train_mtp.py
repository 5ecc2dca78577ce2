"""`specport train-mtp ARTIFACT --heads K --data FILE --out DIR`: add MTP heads to an artifact.

Trains K DeepSeek-V3-style MTP heads by self-distillation against the frozen base model (or
takes a DeepSeek-V3 checkpoint's own MTP layers) and writes a new artifact whose graph verifies
drafts and proposes the next ones in one run; use it with `specport generate DIR
--speculative mtp`.
"""

from __future__ import annotations

import argparse

import specport
from specport.cli import emit_json
from specport.commands._args import POSITIVE, int_at_least, int_between


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train-mtp", help="train MTP draft heads and write an MTP artifact")
    p.add_argument("artifact", help="artifact exported by `specport export` (either KV layout)")
    p.add_argument(
        "--heads",
        type=int_between(1, 16),
        default=3,
        help="number of chained MTP heads K (default 3)",
    )
    p.add_argument("--data", help="training text, documents separated by blank lines")
    p.add_argument(
        "--chat",
        action="store_true",
        help="each --data document is a user message: the heads learn the model's own answers "
        "under its chat template (for chat models)",
    )
    p.add_argument(
        "--out",
        required=True,
        help="artifact directory to write: new, empty, or an artifact (never the input)",
    )
    p.add_argument("--steps", type=POSITIVE, default=600, help="optimizer steps (default 600)")
    p.add_argument(
        "--sequences",
        type=int_at_least(16),
        default=768,
        help="self-generated training sequences (default 768)",
    )
    p.add_argument(
        "--batch",
        type=POSITIVE,
        default=32,
        help="sequences per optimizer step (default 32; lower it for large vocabularies: each "
        "step holds batch x length x vocab logits per head)",
    )
    p.add_argument(
        "--window",
        type=int_at_least(4),
        default=None,
        help="train each step on a random slice of this many tokens of every sequence "
        "(default: all positions; 32 makes large-vocabulary models several times cheaper)",
    )
    p.add_argument(
        "--draft-vocab",
        type=int_at_least(0),
        default=None,
        metavar="N",
        help="the heads score only the N tokens the training answers use most (0: the whole "
        "vocabulary; default: 8192 on vocabularies over 16384 tokens, else 0). On a large vocabulary the heads' LM head is most of their "
        "cost; a few thousand rows keep nearly every accepted draft",
    )
    p.add_argument(
        "--threads",
        type=POSITIVE,
        default=1,
        help="threads for training and for decoding the training answers (default 1)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    manifest = specport.train_mtp(
        args.artifact,
        args.out,
        num_heads=args.heads,
        data=args.data,
        steps=args.steps,
        num_sequences=args.sequences,
        batch=args.batch,
        chat=args.chat,
        window=args.window or 0,
        draft_vocab=args.draft_vocab,
        threads=args.threads,
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
