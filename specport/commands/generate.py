"""`specport generate ARTIFACT --prompt TEXT`: stream text, or print one JSON object.

`--chat TEXT` runs one chat turn through the artifact's chat template (`specport chat` is
the interactive form). Several `--prompt`s (or `--prompt-ids`, `--chat`) make a batch.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import specport
from specport.cli import emit_json
from specport.commands._args import (
    add_runtime_options,
    add_sampling_options,
    add_speculative_options,
    add_tree_width_option,
    check_sampling,
    check_speculative,
)
from specport.core.errors import InputError, UsageError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text from an artifact")
    p.add_argument("artifact")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--prompt",
        action="append",
        help="prompt text (tokenized with the artifact's tokenizer); repeat for a batch",
    )
    src.add_argument(
        "--prompt-ids",
        action="append",
        help="comma-separated token ids, e.g. 1,403,407; repeat for a batch",
    )
    src.add_argument(
        "--chat",
        action="append",
        metavar="TEXT",
        help="a user message, sent through the artifact's chat template (one turn; "
        "`specport chat` for a conversation); repeat for a batch",
    )
    p.add_argument("--system", help="system message for --chat")
    add_sampling_options(p)
    add_speculative_options(p, "speculative decoding method", num_draft_default=None)
    p.add_argument(
        "--adaptive",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="choose the draft length per step from recent acceptance (default: per method)",
    )
    add_tree_width_option(p)
    add_runtime_options(p)
    p.add_argument(
        "--json",
        action="store_true",
        help='print {"tokens", "text", "metrics"} instead of streaming (one line per prompt)',
    )
    p.set_defaults(run=run)


def parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise UsageError(
            f"--prompt-ids must be comma-separated integers (e.g. 1,403,407), got {text!r}."
        ) from None
    if not ids:
        raise UsageError("--prompt-ids is empty; give comma-separated token ids, e.g. 1,403,407.")
    return ids


def check_args(args: argparse.Namespace) -> bool:
    """Everything about the options alone; returns whether decoding samples."""
    sampling = check_sampling(args)
    n = len(args.prompt or args.prompt_ids or args.chat or [])
    if args.system is not None and not args.chat:
        raise UsageError("--system goes with --chat; add --chat TEXT or drop --system.")
    check_speculative(args)
    if args.tree_width != 1 and n > 1:
        raise UsageError("--tree-width runs one prompt at a time; pass a single prompt.")
    if args.adaptive is not None and args.speculative is None:
        raise UsageError("--adaptive tunes speculative decoding; add --speculative or drop it.")
    return sampling


def chat_prompt_ids(model: Any, messages: list[dict[str, str]]) -> list[int]:
    """The prompt ids of `messages` under the artifact's chat template, or a clear error."""
    from specport.core.chat_template import load_chat_template

    template = load_chat_template(model)
    if template is None:
        raise InputError(
            f"{model.path} has no chat template (chat_template.jinja or tokenizer_config.json); "
            "use --prompt for plain text, or export a chat model."
        )
    return template.render_ids(messages)


def run(args: argparse.Namespace) -> int:
    sampling = check_args(args)
    ids_list = [parse_ids(t) for t in args.prompt_ids] if args.prompt_ids else None
    model = specport.load(
        args.artifact,
        provider=args.provider,
        threads=args.threads,
        mtp_branch=args.speculative == "mtp" and args.tree_width == 1,  # MTP trees derive their own
        suffix_corpus=args.suffix_corpus,
    )
    if args.prompt and model.tokenizer is None:
        raise UsageError(
            f"{args.artifact} has no tokenizer, so it cannot read text; pass token ids with "
            "--prompt-ids 1,2,3 instead of --prompt."
        )
    if args.chat:
        system = [{"role": "system", "content": args.system}] if args.system else []
        ids_list = [
            chat_prompt_ids(model, [*system, {"role": "user", "content": c}]) for c in args.chat
        ]
    texts: list[str] | None = args.prompt
    prompts = texts or ids_list or []
    if len(prompts) > 1:
        return _run_batch(model, args, texts, ids_list, sampling)
    ids = ids_list[0] if ids_list else None

    def stream(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    result = model.generate(
        texts[0] if texts else None,
        prompt_ids=ids,
        on_text=None if args.json else stream,
        tree_width=args.tree_width,
        **generation_options(args, sampling),
    )
    if args.json:
        emit_json(result.to_json())
    else:
        if model.tokenizer is None:
            print(" ".join(map(str, result.tokens)))
        else:
            print()
        m = result.metrics
        print(
            f"[{m['new_tokens']} tokens, ttft {m['ttft_ms']:.1f} ms, decode {m['decode_tok_per_s'] or 0:.1f} tok/s, "
            f"{m['provider']}, finish: {result.finish_reason}]",
            file=sys.stderr,
        )
    return 0


def generation_options(args: argparse.Namespace, sampling: bool) -> dict[str, Any]:
    """The keyword arguments `Model.generate` and `Model.generate_batch` share (and chat's
    turns: it has no --adaptive, so that one defaults to the method's choice)."""
    return {
        "max_new_tokens": args.max_new_tokens,
        "greedy": not sampling,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "min_p": args.min_p,
        "repetition_penalty": args.repetition_penalty,
        "seed": args.seed,
        "ignore_eos": args.ignore_eos,
        "stop": args.stop,
        "speculative": getattr(args, "speculative", None),
        "num_draft": getattr(args, "num_draft", None),
        "draft": getattr(args, "draft", None),
        "adaptive": getattr(args, "adaptive", None),
    }


def _run_batch(
    model: Any,
    args: argparse.Namespace,
    texts: list[str] | None,
    ids_list: list[list[int]] | None,
    sampling: bool,
) -> int:
    """Several prompts: one batched call; JSON lines with --json, else one block per prompt.

    Each JSON line carries its own prompt and metrics (its prompt and new token counts; the
    timings are the batch's)."""
    results = model.generate_batch(texts, prompt_ids=ids_list, **generation_options(args, sampling))
    given = args.prompt or args.chat or args.prompt_ids
    for i, result in enumerate(results):
        if args.json:
            row = {"index": i, "prompt": given[i], **result.to_json()}
            emit_json(row)
            continue
        body = result.text if model.tokenizer is not None else " ".join(map(str, result.tokens))
        print(f"[{i}] {body}")
        print(
            f"[{i}: {len(result.tokens)} tokens, finish: {result.finish_reason}]", file=sys.stderr
        )
    m = results[0].metrics
    print(
        f"[batch {len(results)}, {m.get('batch_new_tokens')} new tokens, decode "
        f"{m.get('decode_tok_per_s') or 0:.1f} tok/s, {m.get('provider')}]",
        file=sys.stderr,
    )
    return 0
