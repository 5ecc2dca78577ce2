"""A corpus for `--speculative suffix`: the artifact's own greedy answers to typical messages.

    python -m specport.samples.chat_distill --messages MSGS.txt          # or your own messages
    python -m specport.samples.suffix_corpus ARTIFACT --messages MSGS.txt --out CORPUS.jsonl
    specport generate ARTIFACT --chat "..." --speculative suffix --suffix-corpus CORPUS.jsonl

Suffix drafting continues the current answer the way earlier answers continued the same
words, so its corpus should be what the model itself writes for the traffic it will serve
(a server also learns every answer it sends). The answers are decoded greedily by
onnxruntime on the artifact, batched; the file is JSON lines with the ids and their text.
Real chat logs of the same model work too (``{"text": ...}`` lines).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from specport.core.errors import InputError, SpecportError
from specport.loading import load
from specport.runtime.speculative.suffix_corpus import write_corpus

logger = logging.getLogger(__name__)


def build_corpus(
    artifact: str, messages: Path, out: Path, limit: int, new_tokens: int, threads: int
) -> int:
    """Answer up to ``limit`` messages with the artifact and write them to ``out``; returns
    the number of answers."""
    from specport.train.mtp_data import chat_prompts, greedy_answers

    if out.exists():
        raise InputError(f"--out {out} exists; choose a new file (nothing is overwritten).")
    model = load(artifact, threads=threads)
    prompts = chat_prompts(messages, model.path, model.tokenizer, limit)
    answers = [a for _, batch in greedy_answers(model, prompts, new_tokens, 16) for a in batch]
    eos = set(model.manifest.eos_token_ids)
    answers = [[t for t in a if t not in eos] for a in answers]
    write_corpus(out, answers, [model.decode(a) for a in answers])
    logger.info("wrote %d answers (%d tokens) to %s", len(answers), sum(map(len, answers)), out)
    return len(answers)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m specport.samples.suffix_corpus", description=__doc__
    )
    p.add_argument("artifact")
    p.add_argument("--messages", type=Path, required=True, help="one message per paragraph")
    p.add_argument("--out", type=Path, required=True, help="new JSON-lines file")
    p.add_argument("--limit", type=int, default=1024, help="at most this many messages")
    p.add_argument("--new-tokens", type=int, default=256, help="longest answer (tokens)")
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        build_corpus(
            args.artifact, args.messages, args.out, args.limit, args.new_tokens, args.threads
        )
    except SpecportError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
