"""`specport train-draft ARTIFACT --out DIR`: give an artifact an EAGLE draft head.

The head is one small decoder layer fed by the target's own hidden states (three layers,
exported as an extra output of the target graph) and trained on the model's own answers to real
requests (by default the 120 human-written self-instruct tasks specport ships); use the result
with `--speculative eagle` in generate, chat, serve and bench.
"""

from __future__ import annotations

import argparse

import specport
from specport.cli import emit_json
from specport.commands._args import POSITIVE, int_at_least, int_between
from specport.drafting import (
    DEFAULT_DATA_KIND,
    DEFAULT_MESSAGES,
    DEFAULT_SEQUENCES,
    MESSAGES,
)
from specport.train.draft_data import KINDS as DATA_KINDS
from specport.train.eagle_cache import LABELS, TOP_K


def _minutes(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of minutes, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"--minutes must be positive, got {text}")
    return value


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train-draft", help="train an EAGLE draft head and write an artifact that carries it"
    )
    p.add_argument("artifact", help="artifact exported by `specport export` (never modified)")
    p.add_argument(
        "--out",
        required=True,
        help="artifact directory to write: a new one, or one an earlier run wrote from the same "
        "artifact, whose head then trains on up to --minutes in all",
    )
    p.add_argument(
        "--data",
        help="training data (default: 120 real requests shipped with specport, the "
        "self-instruct seed tasks; see --messages): JSONL or JSON records "
        "(instruction + input + output / response, OpenAI messages, ShareGPT conversations, "
        "MT-bench turns) or plain text, one example per paragraph",
    )
    p.add_argument(
        "--data-kind",
        choices=DATA_KINDS,
        default=DEFAULT_DATA_KIND,
        help="with --data: the model's own answers to its prompts (answers), its written "
        "answers or paragraphs read by the target without generating (text: several times "
        f"cheaper per position), or both (mixed); default {DEFAULT_DATA_KIND}",
    )
    p.add_argument(
        "--data-split",
        choices=["all", "tune", "eval"],
        default="all",
        help="with --data: all of it (default) or the seeded half bench --prompts-split tune "
        "(or eval) takes at --seed 0, so a head trained on tune is measured on eval",
    )
    p.add_argument(
        "--messages",
        choices=MESSAGES,
        default=None,
        help="without --data, what the model answers: real requests shipped with specport "
        "(instructions: 120 self-instruct seed tasks, Apache-2.0), the built-in templated "
        "collection (builtin), requests the model writes itself (self: sampled after its chat "
        f"template's user header), or half of the last two (mixed); default {DEFAULT_MESSAGES}",
    )
    p.add_argument(
        "--eval-data",
        action="append",
        default=[],
        metavar="FILE",
        help="a prompt file (as --data) whose answers are measured at every point of the "
        "training timeline, beside the bench's chat prompts and the 55 self-instruct tasks "
        "held apart from the default data; repeatable",
    )
    p.add_argument(
        "--minutes",
        type=_minutes,
        default=10.0,
        help="training time for the head after the answers and features are computed "
        "(default 10); a rerun with the same --out resumes, a larger value trains further",
    )
    p.add_argument(
        "--discard-data",
        action="store_true",
        help="remove OUT.training (the answers, the feature cache and the checkpoint, kept "
        "by default so a longer run resumes) once OUT is written",
    )
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="where the head trains (cuda when torch sees a GPU)",
    )
    p.add_argument(
        "--sequences",
        type=int_at_least(16),
        default=DEFAULT_SEQUENCES,
        help=f"prompts to answer for training (default {DEFAULT_SEQUENCES}); a rerun with more "
        "answers only the new ones",
    )
    p.add_argument(
        "--new-tokens", type=POSITIVE, default=128, help="tokens per answer (default 128)"
    )
    p.add_argument(
        "--draft-vocab",
        type=int_at_least(16),
        default=None,
        metavar="N",
        help="the head predicts the N tokens the answers use most (default 8192 on "
        "vocabularies over 16384 tokens, else all)",
    )
    p.add_argument(
        "--depth",
        type=int_between(1, 8),
        default=4,
        help="draft positions trained (training-time test; default 4)",
    )
    p.add_argument(
        "--labels",
        choices=LABELS,
        default=LABELS[0],
        help=f"what the head learns: the target's top-{TOP_K} distribution (soft, default) or "
        "its greedy choice only",
    )
    p.add_argument("--threads", type=POSITIVE, default=2, help="threads (default 2)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from specport.core.errors import UsageError
    from specport.drafting import data_size, training_dir

    if args.data and args.messages:
        raise UsageError("give --data FILE or --messages, not both: --data is what is answered.")
    if args.data_split != "all" and not args.data:
        raise UsageError("--data-split picks from --data FILE; add --data FILE.")

    manifest = specport.train_draft(
        args.artifact,
        args.out,
        data=args.data,
        minutes=args.minutes,
        device=args.device,
        sequences=args.sequences,
        new_tokens=args.new_tokens,
        draft_vocab=args.draft_vocab,
        depth=args.depth,
        threads=args.threads,
        progress=False if args.json else None,
        keep_data=not args.discard_data,
        labels=args.labels,
        messages=args.messages or DEFAULT_MESSAGES,
        data_kind=args.data_kind,
        data_split=args.data_split,
        eval_data=tuple(args.eval_data),
    )
    training = manifest.extra["eagle"]["training"]
    held = training["heldout"]
    work = training_dir(args.out)
    size = data_size(args.out)
    if args.json:
        data = {"path": str(work), "bytes": size} if size else None
        emit_json({"artifact": str(args.out), "training": training, "training_data": data})
    else:
        rates = ", ".join(f"{r:.2f}" for r in held["acceptance_per_position"])
        print(
            f"wrote {args.out} with an EAGLE draft head ({manifest.extra['eagle']['draft_vocab']} "
            f"draft tokens, {training['minutes']} minutes, {training['steps']} steps); held-out "
            f"acceptance per position [{rates}], {held['expected_tokens_per_step']} tokens per "
            f"verify step expected. Run it with --speculative eagle."
        )
        labels = {
            "chat_prompts": "the benchmark's chat prompts (bench --prompt-set chat)",
            "more_chat_prompts": "16 other chat prompts (--prompt-set chat-more)",
            "self_instruct_heldout": "the 55 self-instruct tasks held apart",
        }
        timeline = training.get("timeline") or [{}]
        names = [k for k in timeline[-1] if isinstance(timeline[-1][k], dict) and k != "heldout"]
        for key, label in ((k, labels.get(k, k)) for k in names):
            chat = training.get(key)
            if chat:
                rates = ", ".join(f"{r:.2f}" for r in chat["acceptance_per_position"])
                print(
                    f"on {label}: acceptance per position [{rates}], "
                    f"{chat['expected_tokens_per_step']} tokens per step"
                )
        if size:
            print(
                f"the training data stays in {work} ({size / 1e6:.0f} MB): rerun with a larger "
                f"--minutes to train further, or remove it (rm -r {work})."
            )
    return 0
