"""Per prompt: does greedy speculation give the artifact's plain greedy tokens?

    python -m benchmarks.quant_agreement ART [ART ...] [--prompt-set chat] [--methods ngram suffix]
        [--num-draft 4] [--new-tokens 128] [--batch]

For each artifact, each prompt of the set is decoded plainly and with each method (EOS ends
an answer, as users see it); a prompt agrees when the token lists are equal. Prints, per
method, the agreeing prompts and the first position where a disagreeing answer leaves plain
greedy's (the median over those prompts). `--batch` also runs
the prompts as one `generate_batch` call (the batched generator) per method.
"""

from __future__ import annotations

import argparse
import os
import statistics
from typing import Any

import specport
from specport.bench.prompt_sets import chat_prompt_ids


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifacts", nargs="+")
    ap.add_argument("--prompt-set", default="chat")
    ap.add_argument("--methods", nargs="+", default=["ngram"])
    ap.add_argument("--num-draft", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", action="store_true")
    args = ap.parse_args(argv)
    print("load average", os.getloadavg())
    for path in args.artifacts:
        model = specport.load(path, threads=args.threads)
        prompts = chat_prompt_ids(model, args.prompt_set)
        kw: dict[str, Any] = dict(max_new_tokens=args.new_tokens)
        plain = [model.generate(prompt_ids=p, **kw).tokens for p in prompts]
        exact = (model.manifest.quant or {}).get("token_exact_speculation")
        print(f"{path}: {len(prompts)} prompts, {args.new_tokens} new tokens, verdict {exact}")
        runs: list[tuple[str, list[list[int]]]] = []
        for method in args.methods:
            got = [
                model.generate(
                    prompt_ids=p, speculative=method, num_draft=args.num_draft, **kw
                ).tokens
                for p in prompts
            ]
            runs.append((f"{method} (Model.generate)", got))
            if args.batch:
                batch = model.generate_batch(
                    prompt_ids=prompts, speculative=method, num_draft=args.num_draft, **kw
                )
                runs.append((f"{method} (generate_batch)", [o.tokens for o in batch]))
        for name, got in runs:
            agree = sum(g == w for g, w in zip(got, plain))
            first = [
                next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
                for g, w in zip(got, plain)
                if g != w
            ]
            where = (
                f", first difference at token {statistics.median(first):.0f} (median)"
                if first
                else ""
            )
            print(f"  {name:<28} agree {agree}/{len(prompts)}{where}")
        print("load average", os.getloadavg())


if __name__ == "__main__":
    main()
