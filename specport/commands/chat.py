"""`specport chat ARTIFACT`: talk to a chat model, turn by turn, answers streamed.

Each turn renders the whole conversation with the artifact's chat template (as the model was
tuned), so the model sees its earlier answers. `/reset` starts over, `/exit` (or EOF, Ctrl-D)
ends; Ctrl-C stops an answer mid-way (it is kept as far as it got) and, at the prompt, ends
the chat. When the conversation outgrows the context, the oldest turns are dropped (the
system message stays) with a note on stderr. Stdin may be a pipe: one message per line.

`--speculative` (and `--tree-width`) drafts and verifies as in `generate` (greedy answers are
plain greedy's);
with `suffix`, each finished answer is learned, so later turns (and, with `--suffix-record`,
later chats) draft from earlier answers.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from specport.commands._args import (
    add_runtime_options,
    add_sampling_options,
    add_speculative_options,
    add_suffix_record_option,
    add_tree_width_option,
    check_sampling,
    check_speculative,
)
from specport.commands._prompt import LineReader, line_reader
from specport.commands.generate import generation_options
from specport.core.errors import ContextLengthError, InputError

HELP = "commands: /reset (start over), /exit (quit); Ctrl-C stops an answer"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "chat", help="interactive chat with an artifact's chat template (streamed, multi-turn)"
    )
    p.add_argument("artifact")
    p.add_argument("--system", help="system message at the start of the conversation")
    add_sampling_options(p)
    p.set_defaults(max_new_tokens=256)
    add_speculative_options(
        p,
        "draft and verify each answer (greedy answers equal plain greedy's); suffix also "
        "learns every answer, so later turns draft from earlier ones",
        num_draft_default=None,
    )
    add_tree_width_option(p)
    add_suffix_record_option(p)
    add_runtime_options(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from specport.commands._speculative import load_model, start_recording
    from specport.core.chat_template import load_chat_template

    sampling = check_sampling(args)
    check_speculative(args)
    model, record_largest = load_model(args)
    template = load_chat_template(model)
    if template is None:
        raise InputError(
            f"{args.artifact} has no chat template (chat_template.jinja or tokenizer_config.json); "
            "chat needs a chat model. Use `specport generate --prompt TEXT` for plain text."
        )
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"chatting with {args.artifact}; {HELP}", file=sys.stderr)
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict[str, str]] = []
    options = generation_options(args, sampling)
    options["tree_width"] = args.tree_width
    if args.draft:  # loaded once, not per turn
        options["draft"] = model.draft_model(args.draft)  # on the target's provider and threads
    recorder = start_recording(model, args, record_largest)
    try:
        with line_reader() as reader:
            return _converse(
                model,
                template,
                system,
                history,
                options,
                reader if interactive else None,
                interactive,
            )
    finally:
        if recorder is not None:
            recorder.close()


def _converse(
    model: Any,
    template: Any,
    system: list[dict[str, str]],
    history: list[dict[str, str]],
    options: dict[str, Any],
    reader: LineReader | None,
    interactive: bool,
) -> int:
    while True:
        try:
            line = reader.read("> ") if reader else input("> " if interactive else "")
        except EOFError:
            if interactive:
                print(file=sys.stderr)
            return 0
        except KeyboardInterrupt:
            print(file=sys.stderr)
            return 0
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            history.clear()
            print("[conversation reset]", file=sys.stderr)
            continue
        if text.startswith("/") and " " not in text:
            print(f"[unknown command {text}; {HELP}]", file=sys.stderr)
            continue
        history.append({"role": "user", "content": text})
        answer = _turn(model, template, system, history, options)
        if answer is None:
            history.pop()  # could not even fit this message: forget it
            continue
        history.append({"role": "assistant", "content": answer})


def _turn(
    model: Any,
    template: Any,
    system: list[dict[str, str]],
    history: list[dict[str, str]],
    options: dict[str, Any],
) -> str | None:
    """One answer, streamed to stdout; None when the message does not fit the context."""
    ids = _fit(model, template, system, history, int(options["max_new_tokens"]))
    if ids is None:
        return None
    pieces: list[str] = []

    def show(piece: str) -> None:
        pieces.append(piece)
        sys.stdout.write(piece)
        sys.stdout.flush()

    try:
        result = model.generate(prompt_ids=ids, on_text=show, **options)
        if options.get("speculative") in ("suffix", "auto"):  # later turns draft from it
            model.suffix_index.learn_answer(result.tokens)
    except KeyboardInterrupt:
        print("\n[answer stopped]", file=sys.stderr)
    except ContextLengthError as e:
        print(f"\n[{e}]", file=sys.stderr)
    print()
    return "".join(pieces)


def _fit(
    model: Any,
    template: Any,
    system: list[dict[str, str]],
    history: list[dict[str, str]],
    max_new_tokens: int,
) -> list[int] | None:
    """Prompt ids of the conversation, dropping the oldest turns until the answer fits."""
    context = min(model.manifest.context_length, model.manifest.kv.max_length or 1 << 62)
    while True:
        ids: list[int] = template.render_ids([*system, *history])
        if len(ids) + 1 <= context:
            room = context - len(ids)
            if room < max_new_tokens:
                print(
                    f"[only {room} tokens of context left for the answer]",
                    file=sys.stderr,
                )
            return ids
        if len(history) <= 1:
            print(
                f"[that message is {len(ids)} tokens; the model's context is {context}. "
                "Send a shorter one, or /reset]",
                file=sys.stderr,
            )
            return None
        del history[:2]  # the oldest user message and its answer
        print("[dropped the oldest turn to fit the context]", file=sys.stderr)
