"""Per-token cost of a structured-output mask: xgrammar (what specport uses) vs llguidance.

    python -m benchmarks.grammar SHARED/models/smollm2-135m-instruct \
        --gguf SmolLM2-135M-Instruct.Q4_1.gguf

(SHARED: the shared data folder, specport's setting SPECPORT_SHARED, by default beside the checkout.)

Loads the tokenizer with transformers (a GGUF file's, with --gguf), compiles one JSON schema
with each library, and times filling the next-token mask along a fixed 32-token answer with warm
matchers (the first matcher of each library is discarded).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "tags"],
}
ANSWER = {"name": "Alice Smith", "age": 42, "tags": ["a", "bb", "ccc", "dddd"]}


def _xgrammar(tok: Any, vocab: int, ids: list[int]) -> list[float]:
    import xgrammar as xgr

    compiled = xgr.GrammarCompiler(
        xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    ).compile_json_schema(json.dumps(SCHEMA))
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    times: list[float] = []
    for _ in range(2):
        matcher, times = xgr.GrammarMatcher(compiled), []
        for t in ids:
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            times.append(time.perf_counter() - t0)
            matcher.accept_token(t)
    return times


def _llguidance(tok: Any, vocab: int, ids: list[int]) -> list[float]:
    import llguidance
    import llguidance.hf
    import llguidance.numpy as lnp

    ltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    mask = lnp.allocate_token_bitmask(1, vocab)
    times: list[float] = []
    for _ in range(2):
        matcher, times = llguidance.LLMatcher(ltok, grammar), []
        for t in ids:
            t0 = time.perf_counter()
            lnp.fill_next_token_bitmask(matcher, mask, 0)
            times.append(time.perf_counter() - t0)
            matcher.consume_token(t)
    return times


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("tokenizer", help="a tokenizer directory (transformers)")
    p.add_argument("--gguf", help="the GGUF file in that directory to read the tokenizer from")
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    kwargs = {"gguf_file": args.gguf} if args.gguf else {}
    tok = AutoTokenizer.from_pretrained(args.tokenizer, **kwargs)
    vocab = len(tok)
    ids = tok.encode(json.dumps(ANSWER), add_special_tokens=False)
    print(f"vocabulary {vocab}, answer {len(ids)} tokens; mask fill per token (ms):")
    for name, run in (("xgrammar", _xgrammar), ("llguidance", _llguidance)):
        t = np.asarray(run(tok, vocab, ids)) * 1e3
        print(
            f"  {name:<11} median {np.median(t):.3f}  p90 {np.percentile(t, 90):.3f}  "
            f"max {t.max():.3f}"
        )


if __name__ == "__main__":
    main()
