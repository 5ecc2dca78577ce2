"""Quality metrics of an artifact on text: perplexity, and agreement between two artifacts.

Protocol (kept identical everywhere so numbers compare): documents are separated by blank
lines; each gets BOS prepended and is truncated to the context; the model runs each document
as one prefill with past length 0; the loss is the token-weighted mean NLL over all predicted
tokens (positions 1..T-1 of every document), perplexity = exp(loss).

`chunk=N` feeds each document N tokens per run instead, carrying the KV cache (presents fed
back as pasts) the way generation does: the only way to score what a model reads back from its
cache (e.g. an int8 KV cache, which a single prefill with an empty past never reads).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from specport.artifact.manifest import read_manifest
from specport.core.contract import prefill_feeds, with_causal_tree_mask
from specport.core.documents import read_text_documents
from specport.core.errors import InputError
from specport.core.progress import track
from specport.runtime.kv.seq_cache import open_cache
from specport.runtime.session import artifact_graph, artifact_session_entries

logger = logging.getLogger(__name__)

PathLike = str | os.PathLike[str]


@dataclass
class _Model:
    sess: ort.InferenceSession
    tokenizer_file: Path
    bos_token_id: int | None
    context: int | None
    manifest: Any = None  # a shared-layout artifact's manifest (scored through its KV buffers)


def _open(path: PathLike, providers: list[str] | None = None) -> _Model:
    """An artifact directory (manifest + tokenizer) or a bare .onnx next to a tokenizer.json."""
    p = Path(path)
    bos: int | None = None
    context: int | None = None
    entries: dict[str, str] = {}
    shared: Any = None
    if p.is_dir():
        m = read_manifest(p, check_hashes=False)
        shared = m if m.kv.layout == "shared" else None
        onnx_path, tok_dir = p / m.model_file, p

        graph, extra = artifact_graph(p, m, mtp_branch=False)  # scoring needs no MTP heads
        bos = m.config.get("bos_token_id")
        context = m.config.get("context_length")
        if shared is not None and m.kv.max_length:  # a document fits the KV buffer
            context = min(context or m.kv.max_length, m.kv.max_length)
        entries = {**artifact_session_entries(m), **extra}
    elif p.suffix == ".onnx" and p.is_file():
        onnx_path, tok_dir = p, p.parent
        graph = str(onnx_path)
    else:
        raise InputError(f"{p} is neither an artifact directory nor an .onnx file")
    tok = tok_dir / "tokenizer.json"
    if not tok.is_file():
        raise InputError(
            f"no tokenizer.json beside {onnx_path}; evaluation needs the artifact's tokenizer"
        )
    so = ort.SessionOptions()
    so.log_severity_level = 3
    # Idle ORT threads spin by default and starve the numpy work done between runs.
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    for key, value in entries.items():  # what the artifact's recipe needs (e.g. W4A16 QDQ)
        so.add_session_config_entry(key, value)
    sess = ort.InferenceSession(graph, so, providers=providers or ["CPUExecutionProvider"])
    return _Model(sess, tok, bos, context, shared)


def read_documents(
    text_file: PathLike, max_docs: int | None = None, last: bool = False
) -> list[str]:
    """Blank-line separated documents of `text_file` (the first or last `max_docs`)."""
    p = Path(text_file)
    docs = read_text_documents(p)
    if docs is None:
        raise InputError(f"text file not found: {p}")
    if not docs:
        raise InputError(f"{p} holds no documents (they are separated by blank lines)")
    if max_docs is not None:
        docs = docs[-max_docs:] if last else docs[:max_docs]
    return docs


def _encode(model: _Model, docs: list[str], context: int | None) -> list[np.ndarray]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model.tokenizer_file))
    ctx = context or model.context
    out = []
    for d in docs:
        ids = tok.encode(d, add_special_tokens=False).ids
        if model.bos_token_id is not None:
            ids = [int(model.bos_token_id), *ids]
        if ctx:
            ids = ids[:ctx]
        if len(ids) >= 2:
            out.append(np.asarray(ids, dtype=np.int64))
    return out


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _logits(model: _Model, ids: np.ndarray, chunk: int | None = None) -> np.ndarray:
    """ids [T] -> logits [T, V]; with `chunk`, N tokens per run on top of the carried KV."""
    if model.manifest is not None:  # shared layout: logits_index selects every position
        cache = open_cache(model.sess, model.manifest, len(ids))
        size = chunk or len(ids)
        # a step's logits live in the bound output buffer, which the next step of the same
        # width overwrites: copy each chunk's before running the next
        return np.concatenate(
            [cache.step(ids[i : i + size].tolist()).logits.copy() for i in range(0, len(ids), size)]
        )
    feeds = prefill_feeds(model.sess, ids)
    if not chunk or chunk >= len(ids):
        (out,) = model.sess.run(["logits"], feeds)
        return np.asarray(out[0])
    pasts = {k: v for k, v in feeds.items() if k.startswith("past_key_values.")}
    if not pasts:
        raise InputError("--chunk needs a model with a KV cache (past_key_values.* inputs)")
    names = ["logits", *(k.replace("past_key_values.", "present.", 1) for k in pasts)]
    parts = []
    for start in range(0, len(ids), chunk):
        end = min(start + chunk, len(ids))
        step = {
            "input_ids": ids[None, start:end],  # [1, S]
            "attention_mask": np.ones((1, end), np.int64),  # [1, P+S]
            "position_ids": np.arange(start, end, dtype=np.int64)[None, :],  # [1, S]
            **pasts,
        }
        outs = model.sess.run(names, with_causal_tree_mask(model.sess, step))
        parts.append(np.asarray(outs[0][0]))
        pasts = dict(zip(pasts, outs[1:]))
    return np.concatenate(parts, axis=0)


def _check_chunk(chunk: int | None) -> None:
    if chunk is not None and chunk < 1:
        raise InputError(f"--chunk must be at least 1, not {chunk}")


def perplexity(
    artifact_or_onnx_path: PathLike,
    text_file: PathLike,
    max_docs: int | None = None,
    context: int | None = None,
    last: bool = False,
    progress: Callable[[int, int], None] | None = None,
    chunk: int | None = None,
) -> dict[str, Any]:
    """Token-weighted perplexity of a model on a text file: {ppl, nll, tokens, docs}."""
    _check_chunk(chunk)
    model = _open(artifact_or_onnx_path)
    seqs = _encode(model, read_documents(text_file, max_docs, last), context)
    total, count = 0.0, 0
    for i, ids in enumerate(seqs):
        lp = _log_softmax(_logits(model, ids, chunk))
        total -= float(lp[np.arange(len(ids) - 1), ids[1:]].sum())
        count += len(ids) - 1
        if progress:
            progress(i + 1, len(seqs))
    if count == 0:
        raise InputError(f"{text_file} gave no tokens to score")
    nll = total / count
    out = {"ppl": math.exp(nll), "nll": nll, "tokens": count, "docs": len(seqs)}
    return {**out, "chunk": chunk} if chunk else out


def compare(
    a: PathLike,
    b: PathLike,
    text_file: PathLike,
    max_docs: int | None = None,
    context: int | None = None,
    last: bool = False,
    chunk: int | None = None,
) -> dict[str, Any]:
    """How closely model `b` follows model `a` on the same text, teacher-forced.

    top1_agreement: fraction of positions where both argmaxes agree; kl: mean KL(a || b) in
    nats per position; also both perplexities.
    """
    _check_chunk(chunk)
    ma, mb = _open(a), _open(b)
    seqs = _encode(ma, read_documents(text_file, max_docs, last), context)
    agree = kl = nll_a = nll_b = 0.0
    n = 0
    for ids in track(seqs, "comparing documents"):
        la, lb = _log_softmax(_logits(ma, ids, chunk)), _log_softmax(_logits(mb, ids, chunk))
        agree += float((la.argmax(-1) == lb.argmax(-1)).sum())
        kl += float((np.exp(la) * (la - lb)).sum())
        idx = np.arange(len(ids) - 1)
        nll_a -= float(la[idx, ids[1:]].sum())
        nll_b -= float(lb[idx, ids[1:]].sum())
        n += len(ids)
    if n == 0:
        raise InputError(f"{text_file} gave no tokens to compare")
    m = n - len(seqs)
    return {
        **({"chunk": chunk} if chunk else {}),
        "top1_agreement": agree / n,
        "kl": kl / n,
        "ppl_a": math.exp(nll_a / m),
        "ppl_b": math.exp(nll_b / m),
        "positions": n,
        "docs": len(seqs),
    }
