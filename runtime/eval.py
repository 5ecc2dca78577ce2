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
from specport.core.weight_size import model_weight_size
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
    onnx_path, tok, m = _model_files(p)
    bos: int | None = None
    context: int | None = None
    entries: dict[str, str] = {}
    shared: Any = None
    if m is not None:
        shared = m if m.kv.layout == "shared" else None
        graph, extra = artifact_graph(p, m, mtp_branch=False)  # scoring needs no MTP heads
        bos = m.config.get("bos_token_id")
        context = m.config.get("context_length")
        if shared is not None and m.kv.max_length:  # a document fits the KV buffer
            context = min(context or m.kv.max_length, m.kv.max_length)
        entries = {**artifact_session_entries(m), **extra}
    else:
        graph = str(onnx_path)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    # Idle ORT threads spin by default and starve the numpy work done between runs.
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    for key, value in entries.items():  # what the artifact's recipe needs (e.g. W4A16 QDQ)
        so.add_session_config_entry(key, value)
    sess = ort.InferenceSession(graph, so, providers=providers or ["CPUExecutionProvider"])
    return _Model(sess, tok, bos, context, shared)


def _model_files(p: Path) -> tuple[Path, Path, Any]:
    """(the graph, the tokenizer, the manifest or None) of an artifact directory or of a bare
    .onnx file."""
    m = None
    if p.is_dir():
        m = read_manifest(p, check_hashes=False)
        onnx_path, tok_dir = p / m.model_file, p
    elif p.suffix == ".onnx" and p.is_file():
        onnx_path, tok_dir = p, p.parent
    else:
        raise InputError(f"{p} is neither an artifact directory nor an .onnx file")
    tok = tok_dir / "tokenizer.json"
    if not tok.is_file():
        raise InputError(
            f"no tokenizer.json beside {onnx_path}; evaluation needs the artifact's tokenizer"
        )
    return onnx_path, tok, m


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
    return compare_many(a, [b], text_file, max_docs, context, last, chunk)[0]


def compare_many(
    a: PathLike,
    others: list[PathLike],
    text_file: PathLike,
    max_docs: int | None = None,
    context: int | None = None,
    last: bool = False,
    chunk: int | None = None,
    memory: int | None = None,
) -> list[dict[str, Any]]:
    """``compare(a, b)`` for every b of ``others``, in order, scoring the reference `a` once
    per document for as many of them as fit in memory together.

    The reference's distribution at every position is what a comparison reads most, and it
    is too large to keep (positions x vocabulary): so each group of others is scored beside
    one pass of the reference. A group holds the others whose files fit in half of the
    memory available now (``memory``: that budget in bytes), at least one; comparing a
    float export with six of its quantizations is then one pass, not six."""
    _check_chunk(chunk)
    for path in others:  # a mistyped name fails now, not after the first group's scoring
        _model_files(Path(path))
    ma = _open(a)
    seqs = _encode(ma, read_documents(text_file, max_docs, last), context)
    if not seqs:
        raise InputError(f"{text_file} gave no tokens to compare")
    results: dict[int, dict[str, Any]] = {}
    for group in _groups(others, memory):
        models = [_open(others[i]) for i in group]
        sums = np.zeros((len(group), 3))  # agreement, KL, NLL of each
        nll_a = 0.0
        n = 0
        for ids in track(seqs, "comparing documents"):
            la = _log_softmax(_logits(ma, ids, chunk))
            pa, top_a, idx = np.exp(la), la.argmax(-1), np.arange(len(ids) - 1)
            nll_a -= float(la[idx, ids[1:]].sum())
            n += len(ids)
            for j, mb in enumerate(models):
                lb = _log_softmax(_logits(mb, ids, chunk))
                sums[j] += (
                    float((top_a == lb.argmax(-1)).sum()),
                    float((pa * (la - lb)).sum()),
                    -float(lb[idx, ids[1:]].sum()),
                )
        del models
        m = n - len(seqs)
        for j, i in enumerate(group):
            results[i] = {
                **({"chunk": chunk} if chunk else {}),
                "top1_agreement": sums[j, 0] / n,
                "kl": sums[j, 1] / n,
                "ppl_a": math.exp(nll_a / m),
                "ppl_b": math.exp(sums[j, 2] / m),
                "positions": n,
                "docs": len(seqs),
            }
    return [results[i] for i in range(len(others))]


def _groups(others: list[PathLike], memory: int | None) -> list[list[int]]:
    """Indices of ``others`` in groups whose files' sizes fit ``memory`` bytes together (half
    of what is available now when None; everything in one group when that is unknown)."""
    if memory is None:
        from specport.runtime.engine.kv_budget import available_memory

        free = available_memory()
        memory = free // 2 if free else None
    groups: list[list[int]] = []
    used = 0
    for i, path in enumerate(others):
        size = model_weight_size(_model_files(Path(path))[0]).file_bytes  # graph + its data
        if not groups or (memory is not None and used + size > memory):
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += size
    return groups
