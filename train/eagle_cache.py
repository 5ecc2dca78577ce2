"""The target's features for EAGLE training, computed once and kept on disk (memory-mapped).

The head trains for many epochs over the same sequences; the 30-layer target is what costs, so
each sequence (prompt + the model's own answer) runs through the target once and its features
([3H] per position, float16), tokens and the target's most likely next tokens with their
probabilities (the first is its greedy choice, the label a verify step accepts; the rest
make the soft labels: a head learns more from the target's whole preference than from its
first choice alone) are written to one directory::

    features.npy  float16 [N, 3H]   all sequences' positions, concatenated
    tokens.npy    int64   [N]
    top_ids.npy   int32   [N, K]    the target's K most likely next tokens (first: its argmax)
    top_probs.npy float16 [N, K]    their probabilities (softmax over the whole vocabulary)
    offsets.npy   int64   [n + 1]   sequence i is rows offsets[i]:offsets[i+1]
    prompts.npy   int64   [n]       prompt length of each sequence (its answer follows)
    done.json                        written last: the cache is complete (and its format)

``done.json`` is written last, so an interrupted run recomputes the cache rather than train on
half of it; the training checkpoint beside it makes a rerun resume. A rerun on more sequences
copies the ones the cache holds and runs only the others.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specport.core.progress import Loop

logger = logging.getLogger(__name__)

DONE = "done.json"
FORMAT = 2  # 2: with the soft labels (top_ids, top_probs); a cache of another format is rebuilt
TOP_K = 16  # soft labels kept per position: their mass is most of the target's on chat
# what a head can learn from the cache: the top-K distribution (soft) or the argmax (greedy);
# here, not in the torch-bound trainer, so the CLI offers them without importing torch
LABELS = ("soft", "greedy")

# ids [S] -> (features [S, 3H] float, top ids [S, K] with the argmax first, their
# probabilities [S, K]): one target run over a whole sequence
RunTarget = Callable[[list[int]], tuple[np.ndarray, np.ndarray, np.ndarray]]


@dataclass
class FeatureCache:
    """A complete cache, memory-mapped."""

    features: np.ndarray  # [N, 3H] float16
    tokens: np.ndarray  # [N] int64
    choices: np.ndarray  # [N] int64 the target's argmax after each position (top_ids[:, 0])
    offsets: np.ndarray  # [n + 1] int64
    prompts: np.ndarray  # [n] int64
    top_ids: np.ndarray | None = None  # [N, K] int32 (None: greedy labels only)
    top_probs: np.ndarray | None = None  # [N, K] float16

    @property
    def num_sequences(self) -> int:
        return len(self.prompts)

    def sequence(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """(features [T, 3H], tokens [T], choices [T], prompt length) of sequence i."""
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.features[a:b], self.tokens[a:b], self.choices[a:b], int(self.prompts[i])

    def soft(self, i: int) -> tuple[np.ndarray, np.ndarray] | None:
        """(top ids [T, K], their probabilities [T, K]) of sequence i, None without them."""
        if self.top_ids is None or self.top_probs is None:
            return None
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.top_ids[a:b], self.top_probs[a:b]


def top_k(logits: np.ndarray, k: int = TOP_K) -> tuple[np.ndarray, np.ndarray]:
    """(ids [S, k] int32, probabilities [S, k] float16) of the k most likely tokens at each
    row of ``logits`` [S, V], most likely first, ties by lower id, and the first column
    exactly ``logits.argmax(-1)``, the greedy label. (torch's top-k: a full sort of a 49k
    vocabulary per position would cost half as much again as the target's run.)"""
    import torch

    x = torch.from_numpy(np.ascontiguousarray(logits, dtype=np.float32))
    k = min(k, x.shape[-1])
    vals, part = torch.topk(x, k, dim=-1)
    log_z = torch.logsumexp(x, -1, keepdim=True)
    vals_np, part_np = vals.numpy(), part.numpy()
    order = np.lexsort((part_np, -vals_np), axis=-1)
    ids = np.take_along_axis(part_np, order, -1)
    top = np.take_along_axis(vals_np, order, -1)
    ids[:, 0] = x.argmax(-1).numpy()  # the first of more than k tied maxima, if ever
    probs = np.exp(top - log_z.numpy())
    return ids.astype(np.int32), probs.astype(np.float16)


def sequences_key(sequences: Sequence[Sequence[int]]) -> str:
    """A digest of the sequences a cache holds: a rerun whose answers changed (other prompts,
    another --new-tokens) recomputes the features instead of training on stale ones."""
    h = hashlib.sha256()
    for s in sequences:
        h.update(np.asarray(s, dtype=np.int64).tobytes())
        h.update(b"|")
    return h.hexdigest()


def is_complete(directory: Path, sequences: Sequence[Sequence[int]] | None = None) -> bool:
    """The cache in ``directory`` was finished (and holds ``sequences``, when given)."""
    done = Path(directory) / DONE
    if not done.is_file():
        return False
    record = json.loads(done.read_text())
    if record.get("format") != FORMAT:
        return False
    return sequences is None or record.get("key") == sequences_key(sequences)


def build_seconds(directory: Path) -> float | None:
    """How long the cache took to compute (recorded when it was built: a resumed run reports
    the real cost of its data, not the moment it took to open it)."""
    seconds = json.loads((Path(directory) / DONE).read_text()).get("seconds")
    return None if seconds is None else float(seconds)


def open_cache(directory: Path) -> FeatureCache:
    d = Path(directory)
    top_ids = np.load(d / "top_ids.npy", mmap_mode="r")
    return FeatureCache(
        np.load(d / "features.npy", mmap_mode="r"),
        np.load(d / "tokens.npy"),
        np.asarray(top_ids[:, 0], dtype=np.int64),
        np.load(d / "offsets.npy"),
        np.load(d / "prompts.npy"),
        top_ids,
        np.load(d / "top_probs.npy", mmap_mode="r"),
    )


def build_cache(
    directory: Path,
    sequences: Sequence[Sequence[int]],  # prompt + answer token ids
    prompt_lens: Sequence[int],
    feature_dim: int,
    run_target: RunTarget,
    progress: bool | None = None,
) -> FeatureCache:
    """Run every sequence through the target once and write the cache (see the module doc).

    A complete cache of exactly these sequences in ``directory`` is opened as it is (a rerun
    pays nothing). Sequences that a complete cache of other sequences holds are copied from it,
    not run again (a training run on more data pays only for the new sequences); the new cache
    is written beside it and replaces it only once complete."""
    d = Path(directory)
    if is_complete(d, sequences):
        return open_cache(d)
    old = open_cache(d) if is_complete(d) else None
    reuse = _rows_by_sequence(old) if old is not None else {}
    if old is not None and old.features.shape[1] != feature_dim:
        reuse = {}
    new = d.with_name(d.name + ".new")
    new.mkdir(parents=True, exist_ok=True)
    (new / DONE).unlink(missing_ok=True)
    t0 = time.perf_counter()
    lengths = np.array([len(s) for s in sequences], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    total = int(offsets[-1])
    feats = np.lib.format.open_memmap(
        new / "features.npy", mode="w+", dtype=np.float16, shape=(total, feature_dim)
    )
    tokens = np.zeros(total, dtype=np.int64)
    top_ids = np.zeros((total, TOP_K), dtype=np.int32)
    top_probs = np.zeros((total, TOP_K), dtype=np.float16)
    copied = 0
    with Loop(total, "computing the target's features", show=progress) as loop:
        for i, seq in enumerate(sequences):
            a, b = int(offsets[i]), int(offsets[i + 1])
            rows = reuse.get(tuple(int(t) for t in seq))
            if rows is not None and old is not None and old.top_ids is not None:
                feats[a:b] = old.features[rows[0] : rows[1]]
                top_ids[a:b] = old.top_ids[rows[0] : rows[1]]
                top_probs[a:b] = np.asarray(old.top_probs)[rows[0] : rows[1]]
                copied += b - a
            else:
                f, ids, probs = run_target(list(seq))
                feats[a:b] = f.astype(np.float16)
                top_ids[a:b, : ids.shape[1]] = ids
                top_probs[a:b, : ids.shape[1]] = probs
            tokens[a:b] = seq
            loop.update(b - a)
    feats.flush()
    del feats
    np.save(new / "tokens.npy", tokens)
    np.save(new / "top_ids.npy", top_ids)
    np.save(new / "top_probs.npy", top_probs)
    np.save(new / "offsets.npy", offsets)
    np.save(new / "prompts.npy", np.asarray(prompt_lens, dtype=np.int64))
    seconds = time.perf_counter() - t0
    if old is not None and copied:  # what the copied rows cost when they were computed
        before = build_seconds(d) or 0.0
        seconds += before * copied / max(int(old.offsets[-1]), 1)
    (new / DONE).write_text(
        json.dumps(
            {
                "sequences": len(sequences),
                "positions": total,
                "seconds": round(seconds, 3),
                "key": sequences_key(sequences),
                "format": FORMAT,
                "top_k": TOP_K,
            }
        )
    )
    del old
    if d.exists():
        stale = d.with_name(d.name + ".old")
        shutil.rmtree(stale, ignore_errors=True)
        os.replace(d, stale)
        os.replace(new, d)
        shutil.rmtree(stale, ignore_errors=True)
    else:
        os.replace(new, d)
    logger.info(
        "feature cache: %d sequences, %d positions (%d copied from the earlier cache) in %s",
        len(sequences),
        total,
        copied,
        d,
    )
    return open_cache(d)


def _rows_by_sequence(cache: FeatureCache) -> dict[tuple[int, ...], tuple[int, int]]:
    """token ids of each cached sequence -> its rows."""
    out = {}
    for i in range(cache.num_sequences):
        a, b = int(cache.offsets[i]), int(cache.offsets[i + 1])
        out[tuple(int(t) for t in cache.tokens[a:b])] = (a, b)
    return out


def frequent_choices(cache: FeatureCache, rows: Sequence[int], size: int, vocab: int) -> np.ndarray:
    """The ``size`` target ids the target chooses most often in the answers of ``rows``
    (sorted by id), the draft vocabulary; rarer ids fill up to ``size`` in id order."""
    counts = np.zeros(vocab, dtype=np.int64)
    for i in rows:
        _, _, choices, p = cache.sequence(int(i))
        np.add.at(counts, choices[max(p - 1, 0) :], 1)
    order = np.argsort(-counts, kind="stable")[: min(size, vocab)]
    return np.sort(order).astype(np.int64)
