"""`specport generate ARTIFACT --prompt TEXT`: stream text, or print one JSON object."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from specport.cli import emit_json
from specport.errors import InputError


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
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument(
        "--greedy",
        action="store_true",
        help="argmax decoding (the default when no sampling option is given)",
    )
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    add_speculative_options(p, "speculative decoding method")
    p.add_argument(
        "--adaptive",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="choose the draft length per step from recent acceptance (default: per method)",
    )
    p.add_argument(
        "--tree-width",
        type=int,
        default=1,
        help="ngram only: verify this many candidate continuations as a token tree in one run "
        "(the artifact must be exported with --tree-mask)",
    )
    add_runtime_options(p)
    p.add_argument(
        "--json",
        action="store_true",
        help='print {"tokens", "text", "metrics"} instead of streaming',
    )
    p.set_defaults(run=run)


def add_speculative_options(p: argparse.ArgumentParser, method_help: str) -> None:
    """--speculative, --num-draft, --draft (generate and serve take the same three)."""
    p.add_argument("--speculative", choices=["ngram", "draft", "mtp"], help=method_help)
    p.add_argument("--num-draft", type=int, default=4, help="draft tokens per step (speculative)")
    p.add_argument("--draft", help="draft artifact for --speculative draft (same vocabulary)")


def add_runtime_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--provider", default="auto", help="auto|cpu|cuda|cann (default auto)")
    p.add_argument(
        "--threads", type=int, default=0, help="intra-op threads (0 = onnxruntime default)"
    )


def parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError as e:
        raise InputError(f"--prompt-ids must be comma-separated integers, got {text!r}.") from e
    if not ids:
        raise InputError("--prompt-ids is empty.")
    return ids


def run(args: argparse.Namespace) -> int:
    from specport import api

    sampling = any(
        [args.temperature != 1.0, args.top_k, args.top_p != 1.0, args.min_p, args.seed is not None]
    )
    if args.greedy and sampling:
        raise InputError(
            "--greedy cannot be combined with --temperature/--top-k/--top-p/--min-p/--seed."
        )
    model = api.load(args.artifact, provider=args.provider, threads=args.threads)
    texts: list[str] | None = args.prompt
    ids_list = [parse_ids(t) for t in args.prompt_ids] if args.prompt_ids else None
    if len(texts or ids_list or []) > 1:
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
        **_generation_options(args, sampling),
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


def _generation_options(args: argparse.Namespace, sampling: bool) -> dict[str, Any]:
    """The keyword arguments `Model.generate` and `Model.generate_batch` share."""
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
        "speculative": args.speculative,
        "num_draft": args.num_draft,
        "draft": args.draft,
        "adaptive": args.adaptive,
    }


def _run_batch(
    model: Any,
    args: argparse.Namespace,
    texts: list[str] | None,
    ids_list: list[list[int]] | None,
    sampling: bool,
) -> int:
    """Several prompts: one batched call; JSON lines with --json, else one block per prompt."""
    if args.tree_width != 1:
        raise InputError("--tree-width runs one prompt at a time; pass a single --prompt.")
    results = model.generate_batch(
        texts, prompt_ids=ids_list, **_generation_options(args, sampling)
    )
    for i, result in enumerate(results):
        if args.json:
            emit_json(result.to_json())
            continue
        body = result.text if model.tokenizer is not None else " ".join(map(str, result.tokens))
        print(f"[{i}] {body}")
        print(
            f"[{i}: {len(result.tokens)} tokens, finish: {result.finish_reason}]", file=sys.stderr
        )
    m = results[0].metrics
    print(
        f"[batch {len(results)}, decode {m.get('decode_tok_per_s') or 0:.1f} tok/s, {m.get('provider')}]",
        file=sys.stderr,
    )
    return 0
