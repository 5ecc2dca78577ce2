"""Prompts nothing can be drafted from, as a prompt file for `specport bench --prompts`.

Speculation must not make these slower than plain decoding: a drafter that guesses from the
prompt finds nothing to copy, and what the model writes after them repeats little. Two kinds,
seeded, in the JSON lines `specport.core.prompt_files` reads:

* ``random-tokens``: token ids drawn uniformly from the artifact's vocabulary, decoded to text,
  sent as they are (a ``text`` record: no chat template);
* ``random-chat``: a chat request to continue a string of random letters and digits;
* ``misleading``: a chat request to continue a table whose every row repeats the same words
  with a new random value after them: prompt lookup always finds a match, and the value it
  copies from an earlier row is wrong.

Usage:

    python benchmarks/adversarial_prompts.py ARTIFACT [--per-kind 2] [--tokens 300] > adversarial.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
import string
from pathlib import Path

from tokenizers import Tokenizer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifact", help="an artifact directory (its tokenizer.json decodes the ids)")
    p.add_argument("--per-kind", type=int, default=2)
    p.add_argument("--tokens", type=int, default=300, help="random ids per random-tokens prompt")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    tok = Tokenizer.from_file(str(Path(args.artifact) / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    rng = random.Random(args.seed)
    for _ in range(args.per_kind):
        ids = [rng.randrange(vocab) for _ in range(args.tokens)]
        print(json.dumps({"category": "random-tokens", "text": tok.decode(ids)}))
    letters = string.ascii_letters + string.digits
    for _ in range(args.per_kind):
        noise = " ".join("".join(rng.choices(letters, k=rng.randint(3, 9))) for _ in range(150))
        prompt = f"Continue this sequence with 100 more items of the same kind:\n\n{noise}"
        print(json.dumps({"category": "random-chat", "prompt": prompt}))
    for _ in range(args.per_kind):
        rows = [
            f"record {rng.randint(1000, 9999)} has the code {''.join(rng.choices(letters, k=6))}"
            for _ in range(60)
        ]
        prompt = "Continue this table with 40 more records:\n\n" + "\n".join(rows)
        print(json.dumps({"category": "misleading", "prompt": prompt}))


if __name__ == "__main__":
    main()
