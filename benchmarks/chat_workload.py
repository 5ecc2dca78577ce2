"""The chat workload of the serving benchmarks, as a `specport loadtest --prompts` file (not a test).

    python -m benchmarks.chat_workload ART OUT.jsonl [--max-tokens 128]

The 16 fixed chat prompts (``samples/chat_prompts.py``: questions, instructions, rewriting a
given paragraph) rendered with the artifact's chat template into the text a chat client's
server would tokenize, one JSON line each with ``max_tokens``. Sent as completions, the same
text reaches every server (specport's, llama.cpp's), which tokenizes it itself; the load test
reports each server's own prompt token count, so a difference in tokenizing shows.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import specport
from specport.core.chat_template import load_chat_template
from specport.core.errors import InputError
from specport.samples.chat_prompts import chat_prompts


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("artifact")
    ap.add_argument("out", type=Path)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args(argv)
    if args.out.exists():
        raise SystemExit(f"chat_workload: {args.out} exists; give a new file")
    template = load_chat_template(specport.load(args.artifact))
    if template is None:
        raise InputError(f"{args.artifact} has no chat template")
    lines = [
        json.dumps(
            {
                "prompt": template.render([{"role": "user", "content": text}]),
                "max_tokens": args.max_tokens,
            }
        )
        for text in chat_prompts()
    ]
    args.out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {len(lines)} chat prompts to {args.out}")


if __name__ == "__main__":
    main()
