"""Argument types and option groups the subcommands share.

Numbers are checked by argparse itself, so `--threads -3` is a usage error (exit 2, with the
usage line) before anything loads, never an odd failure later.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from specport.generation_args import MAX_DRAFT, METHODS, TREE_METHODS


def int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {value}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


def int_between(low: int, high: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be an integer in {low}..{high}, got {value}")
        return value

    parse.__name__ = f"integer in {low}..{high}"
    return parse


def float_in(
    low: float, high: float, low_open: bool = False, what: str = ""
) -> Callable[[str], float]:
    """A finite float in [low, high] (or (low, high] with `low_open`)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        ok = math.isfinite(value) and value <= high and (value > low if low_open else value >= low)
        if not ok:
            span = f"{'(' if low_open else '['}{low:g}, {high:g}]"
            raise argparse.ArgumentTypeError(f"must be in {span}{what}, got {text}")
        return value

    parse.__name__ = "number"
    return parse


POSITIVE = int_at_least(1)
NON_NEGATIVE = int_at_least(0)
PORT = int_between(0, 65535)
TEMPERATURE = float_in(0.0, 1e6, low_open=True, what=" (use --greedy for argmax)")
TOP_P = float_in(0.0, 1.0, low_open=True, what=" (1 turns it off)")
MIN_P = float_in(0.0, 1.0, what=" (0 turns it off)")
PENALTY = float_in(0.0, 1e6, low_open=True, what=" (1 turns it off)")


def add_runtime_options(p: argparse.ArgumentParser) -> None:
    """--provider and --threads (every command that runs an artifact)."""
    p.add_argument(
        "--provider",
        default="auto",
        type=str.lower,
        choices=["auto", "cpu", "cuda", "cann", "qnn", "openvino"],
        help="execution provider (default auto: the best one installed; qnn and openvino are "
        "onnxruntime plugins, never chosen by auto)",
    )
    p.add_argument(
        "--threads",
        type=NON_NEGATIVE,
        default=0,
        help="intra-op threads (0 = onnxruntime default)",
    )


def add_speculative_options(
    p: argparse.ArgumentParser, method_help: str, num_draft_default: int | None = 4
) -> None:
    """--speculative, --num-draft, --draft (generate and serve take the same three).

    `num_draft_default` None lets the API pick (all of an MTP artifact's heads, else 4)."""
    p.add_argument("--speculative", choices=list(METHODS), help=method_help)
    default_text = (
        "all MTP heads for mtp, else 4" if num_draft_default is None else str(num_draft_default)
    )
    p.add_argument(
        "--num-draft",
        type=int_between(1, MAX_DRAFT),
        default=num_draft_default,
        help=f"draft tokens per step with --speculative (default: {default_text})",
    )
    p.add_argument(
        "--draft",
        help="draft artifact for --speculative draft (same vocabulary), or self: the target's "
        "own 4-bit file, made on first use and cached",
    )
    add_suffix_corpus_option(p)


def add_tree_width_option(p: argparse.ArgumentParser) -> None:
    """--tree-width (generate and chat; checked by ``check_speculative``)."""
    p.add_argument(
        "--tree-width",
        type=int_between(1, 16),
        default=1,
        help="ngram, mtp or eagle: verify this many candidate continuations as a token tree in "
        "one run (the artifact must be exported with --tree-mask; for mtp and eagle, heads "
        "trained on it)",
    )


def add_suffix_corpus_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--suffix-corpus",
        metavar="FILE",
        help="for --speculative suffix or auto: earlier answers to draft from, one JSON object "
        'per line with "ids" or "text" (python -m specport.samples.suffix_corpus makes one)',
    )


def add_suffix_record_option(p: argparse.ArgumentParser) -> None:
    """--suffix-record (serve and chat: the answers suffix drafting learns, kept on disk)."""
    p.add_argument(
        "--suffix-record",
        metavar="FILE",
        help="for --speculative suffix: append every answer it learns to FILE (JSON lines; "
        "created if missing, never rewritten); pass FILE as --suffix-corpus next time (the "
        "same FILE for both is fine) to restore them",
    )


def check_speculative(args: argparse.Namespace) -> None:
    """The speculative options that cannot work together (generate, chat and serve)."""
    from specport.core.errors import UsageError

    if getattr(args, "tree_width", 1) != 1 and args.speculative not in TREE_METHODS:
        raise UsageError(
            "--tree-width needs --speculative ngram, mtp or eagle (tree candidates come from "
            "n-gram matches, the MTP heads or the EAGLE head)."
        )
    if args.speculative == "draft" and not args.draft:
        raise UsageError(
            "--speculative draft needs --draft DIR (a small artifact with the same vocabulary, "
            "e.g. from `specport export MODEL --layers 2 --out DIR`)."
        )
    if args.draft and args.speculative not in ("draft", "auto"):
        raise UsageError("--draft is used only with --speculative draft; add it or drop --draft.")
    if args.suffix_corpus and args.speculative not in ("suffix", "auto"):
        raise UsageError(
            "--suffix-corpus is read only by --speculative suffix or auto; add one or drop "
            "--suffix-corpus."
        )
    if getattr(args, "suffix_record", None) and args.speculative not in ("suffix", "auto"):
        raise UsageError(
            "--suffix-record keeps what --speculative suffix learns; add it or drop --suffix-record."
        )
    if args.num_draft is not None and args.speculative is None:
        raise UsageError("--num-draft sets the draft length; add --speculative or drop it.")


def add_sampling_options(p: argparse.ArgumentParser) -> None:
    """Sampling and stopping (generate and chat)."""
    p.add_argument("--max-new-tokens", type=POSITIVE, default=64)
    p.add_argument(
        "--greedy",
        action="store_true",
        help="argmax decoding (the default when no sampling option is given)",
    )
    p.add_argument("--temperature", type=TEMPERATURE, default=1.0)
    p.add_argument("--top-k", type=NON_NEGATIVE, default=0, help="0 turns it off")
    p.add_argument("--top-p", type=TOP_P, default=1.0)
    p.add_argument("--min-p", type=MIN_P, default=0.0)
    p.add_argument("--repetition-penalty", type=PENALTY, default=1.0)
    p.add_argument("--seed", type=NON_NEGATIVE)
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def sampling_requested(args: argparse.Namespace) -> bool:
    """True when any sampling option differs from its default (so decoding samples)."""
    return any(
        [
            args.temperature != 1.0,
            args.top_k,
            args.top_p != 1.0,
            args.min_p,
            args.seed is not None,
        ]
    )


def check_sampling(args: argparse.Namespace) -> bool:
    """Refuse --greedy with sampling options; returns whether decoding samples."""
    from specport.core.errors import UsageError

    sampling = sampling_requested(args)
    if args.greedy and sampling:
        raise UsageError(
            "--greedy cannot be combined with --temperature/--top-k/--top-p/--min-p/--seed; "
            "drop --greedy to sample, or the sampling options for argmax decoding."
        )
    if any(not s for s in args.stop):
        raise UsageError("--stop needs a non-empty string.")
    return sampling
