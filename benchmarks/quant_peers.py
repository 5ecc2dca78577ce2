"""Perplexity of quantized SmolLM2-class files from several tools on the same tokens.

specport artifacts are scored by `specport.runtime.eval.perplexity`; a peer's bare ONNX graph
(onnxruntime-genai's model builder output: input_ids, attention_mask, past_key_values.*) is
scored by the same code with the reference artifact's BOS token and context, so every row sees
the same documents, the same token ids and one prefill per document. Each row prints its bits
per weight as stored (core/weight_size.py) and its perplexity change against its own fp32.

    python -m benchmarks.quant_peers --text T --max-docs 200 --last \\
        --ref smollm \\
        specport:smollm specport:Q genai:GENAI_FP32/model.onnx genai:GENAI_INT4/model.onnx
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from specport.artifact.manifest import read_manifest
from specport.core.weight_size import artifact_weight_size, model_weight_size
from specport.runtime import eval as E


def _genai_logits(model: Any, ids: np.ndarray, head_dim: int) -> np.ndarray:
    """One prefill with an empty cache through the builder's IO (its head dim is symbolic)."""
    feeds: dict[str, np.ndarray] = {}
    for i in model.sess.get_inputs():
        if i.name == "input_ids":
            feeds[i.name] = ids[None, :]
        elif i.name == "attention_mask":
            feeds[i.name] = np.ones((1, len(ids)), np.int64)
        elif i.name == "position_ids":
            feeds[i.name] = np.arange(len(ids), dtype=np.int64)[None, :]
        elif i.name.startswith("past_key_values."):
            feeds[i.name] = np.zeros((1, i.shape[1], 0, head_dim), np.float32)
    (out,) = model.sess.run(["logits"], feeds)
    return np.asarray(out[0])


def score(kind: str, path: str, ref: Path, text: str, max_docs: int, last: bool) -> dict[str, Any]:
    m = read_manifest(ref, check_hashes=False)
    c = m.config
    tied = (int(c["vocab_size"]), int(c["hidden_size"])) if c.get("tie_word_embeddings") else None
    if kind == "specport":
        size = artifact_weight_size(path, read_manifest(path, check_hashes=False))
        model = E._open(path)
    else:  # a bare graph: the reference artifact's tokenizer, BOS and context
        size = model_weight_size(path, tied)
        model = E._open(path)
        model.tokenizer_file = ref / "tokenizer.json"
        model.bos_token_id, model.context = c.get("bos_token_id"), c.get("context_length")
    seqs = E._encode(model, E.read_documents(text, max_docs, last), None)
    t0 = time.perf_counter()
    nll, count = 0.0, 0
    head_dim = int(c["head_dim"])
    for ids in seqs:
        logits = (
            E._logits(model, ids) if kind == "specport" else _genai_logits(model, ids, head_dim)
        )
        lp = E._log_softmax(logits)
        nll -= float(lp[np.arange(len(ids) - 1), ids[1:]].sum())
        count += len(ids) - 1
    return {
        "kind": kind,
        "path": path,
        "ppl": math.exp(nll / count),
        "tokens": count,
        "docs": len(seqs),
        "bits_per_weight": round(size.bits_per_weight, 3),
        "weight_mb": round(size.weight_bytes / 1e6, 1),
        "seconds": round(time.perf_counter() - t0, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="+", help="specport:ARTIFACT or genai:GRAPH.onnx")
    p.add_argument("--ref", required=True, help="the float specport artifact (tokenizer, BOS)")
    p.add_argument("--text", required=True)
    p.add_argument("--max-docs", type=int, default=200)
    p.add_argument("--last", action="store_true")
    args = p.parse_args()
    for spec in args.models:
        kind, path = spec.split(":", 1)
        row = score(kind, path, Path(args.ref), args.text, args.max_docs, args.last)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
