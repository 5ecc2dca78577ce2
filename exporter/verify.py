"""Check an exported graph against PyTorch on fresh random prompts.

Cases cover what breaks KV-cache exports in practice: prefill with past length 0, batch > 1
with left padding, single-token decode steps with past KV, and a multi-token chunk on top of a
past. The same cases check a `shared` KV layout graph (passes/shared_kv.py): each case is
re-laid out as that contract requires (rows compacted and right-padded, the past copied into a
[B, Hkv, T, D] buffer, seqlens_k / total_sequence_length, logits_index picking every real
position), so the graph that ships is the graph that is compared. Verification runs in two phases so that the PyTorch model and the onnxruntime session
never hold the weights at the same time (bounded peak memory for large models): first
`reference_cases` records inputs and PyTorch outputs, then `compare` runs the session.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from specport.core.contract import TREE_MASK, causal_tree_mask
from specport.exporter.wrapper import FlatKVWrapper, kv_input_names

# The shared layout's extra inputs (passes/shared_kv.py, passes/select_logits.py).
SEQLENS = "seqlens_k"
TOTAL = "total_sequence_length"
LOGITS_INDEX = "logits_index"

logger = logging.getLogger(__name__)


@dataclass
class ReferenceCase:
    name: str
    feeds: dict[str, np.ndarray]
    logits: np.ndarray  # [B, S, V] from PyTorch
    present: list[np.ndarray] = field(default_factory=list)
    valid: np.ndarray | None = None  # [B, S] bool: positions that are real tokens
    kv_mask: np.ndarray | None = None  # [B, T] of the present


def positions_from_mask(mask: np.ndarray, seq: int) -> np.ndarray:
    """Position ids of the last `seq` columns of a left-padded mask [B, T] (pads get 0)."""
    pos = np.cumsum(mask, axis=1) - 1
    pos = np.where(mask > 0, pos, 0)
    return pos[:, -seq:].astype(np.int64)


def reference_cases(
    model: Any,
    kv_shapes: list[tuple[int, int, int]],
    vocab_size: int,
    seed: int = 0,
    tree_mask: bool = False,
) -> list[ReferenceCase]:
    """Random inputs and the PyTorch wrapper's outputs for each verification case.

    With `tree_mask` every case also feeds a causal (lower-triangular) `tree_mask` and is still
    compared with the plain model, and one more case scores a branching token tree on top of a
    past, each node compared with a plain chain run of its path.
    """
    import torch

    rng = np.random.default_rng(seed)
    num_layers = len(kv_shapes)
    wrapper = FlatKVWrapper(model, num_layers).eval()
    names = kv_input_names(num_layers)
    cases: list[ReferenceCase] = []

    def forward(ids: np.ndarray, mask: np.ndarray, past: list[np.ndarray]) -> list[np.ndarray]:
        pos = positions_from_mask(mask, ids.shape[1])
        with torch.no_grad():
            out = wrapper(
                torch.from_numpy(ids),
                torch.from_numpy(mask),
                torch.from_numpy(pos),
                *[torch.from_numpy(p) for p in past],
            )
        return [t.numpy().copy() for t in out]

    def run(
        name: str, ids: np.ndarray, mask: np.ndarray, past: list[np.ndarray]
    ) -> list[np.ndarray]:
        arrays = forward(ids, mask, past)
        feeds = {
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": positions_from_mask(mask, ids.shape[1]),
            **dict(zip(names, past)),
        }
        if tree_mask:
            feeds[TREE_MASK] = causal_tree_mask(*ids.shape).copy()
        valid = mask[:, -ids.shape[1] :].astype(bool)
        cases.append(ReferenceCase(name, feeds, arrays[0], arrays[1:], valid, mask.copy()))
        return arrays[1:]

    def empty(batch: int) -> list[np.ndarray]:
        return [np.zeros((batch, h, 0, d), np.float32) for h, kd, vd in kv_shapes for d in (kd, vd)]

    run("prefill_b1", rng.integers(0, vocab_size, (1, 7)), np.ones((1, 7), np.int64), empty(1))
    batch, seq, pad = 2, 6, 2
    mask = np.ones((batch, seq), np.int64)
    mask[0, :pad] = 0
    past = run("prefill_b2_leftpad", rng.integers(0, vocab_size, (batch, seq)), mask, empty(batch))
    for step in range(2):
        mask = np.concatenate([mask, np.ones((batch, 1), np.int64)], axis=1)
        past = run(f"decode_b2_step{step}", rng.integers(0, vocab_size, (batch, 1)), mask, past)
    chunk_mask = np.concatenate([mask, np.ones((batch, 3), np.int64)], axis=1)
    run("chunk_b2_past", rng.integers(0, vocab_size, (batch, 3)), chunk_mask, past)
    if tree_mask:
        cases.append(
            _tree_case(forward, names, rng.integers(0, vocab_size, (batch, 5)), mask, past)
        )
    return cases


def _tree_case(
    forward: Any,
    names: list[str],
    ids: np.ndarray,  # [B, 5] node tokens
    mask: np.ndarray,  # [B, P] the past's padding mask
    past: list[np.ndarray],  # [B, Hkv, P, D]
) -> ReferenceCase:
    """root -> {a -> {c, d}, b} (nodes 0..4, depths 0, 1, 1, 2, 2) on a left-padded past.

    The reference for node n is a plain chain run of its root path: logits at its last token,
    and that token's key/value at slot P + n of the present.
    """
    parents, depths = [-1, 0, 0, 1, 1], np.array([0, 1, 1, 2, 2])
    batch, n, p = ids.shape[0], len(parents), mask.shape[1]
    anc = np.zeros((n, n), np.int64)
    for i, parent in enumerate(parents):
        anc[i] = anc[parent] if parent >= 0 else 0
        anc[i, i] = 1
    full = np.concatenate([mask, np.ones((batch, n), np.int64)], axis=1)
    start = positions_from_mask(mask, 1) + 1  # [B, 1]: each row's next position
    logits: np.ndarray | None = None
    present = [np.concatenate([x, np.zeros_like(x[:, :, :1]).repeat(n, 2)], 2) for x in past]
    for node in range(n):
        path = np.flatnonzero(anc[node])  # ancestors in order, then the node
        chain_mask = np.concatenate([mask, np.ones((batch, len(path)), np.int64)], axis=1)
        out = forward(np.ascontiguousarray(ids[:, path]), chain_mask, past)
        if logits is None:
            logits = np.zeros((batch, n, out[0].shape[-1]), out[0].dtype)
        logits[:, node] = out[0][:, -1]
        for dst, src in zip(present, out[1:]):
            dst[:, :, p + node] = src[:, :, -1]
    assert logits is not None
    feeds = {
        "input_ids": ids,
        "attention_mask": full,
        "position_ids": (start + depths[None]).astype(np.int64),
        TREE_MASK: np.repeat(anc[None], batch, 0),
        **dict(zip(names, past)),
    }
    return ReferenceCase("tree_b2_past", feeds, logits, present, np.ones((batch, n), bool), full)


def compare(
    session: Any, cases: list[ReferenceCase], atol: float = 1e-4, rtol: float = 1e-4
) -> dict[str, Any]:
    """Run each case through `session`; ok when every case is within atol + rtol * max|logits|.

    A session whose graph takes `seqlens_k` is run in the shared KV layout (`run_shared`).
    """
    shared = SEQLENS in {i.name for i in session.get_inputs()}
    cases = [_in_session_types(session, case) for case in cases]
    rows: list[dict[str, Any]] = []
    ok = True
    for case in cases:
        valid = case.valid if case.valid is not None else np.ones(case.logits.shape[:2], bool)
        if shared:
            logits, kv_err = run_shared(session, case)
        else:
            out = session.run(None, case.feeds)
            logits, kv_err = out[0], _concat_kv_err(case, out[1:])
        scale = float(np.abs(case.logits[valid]).max(initial=1.0))
        err = float(np.abs(logits - case.logits)[valid].max(initial=0.0))
        within = err <= atol + rtol * scale
        ok &= within
        rows.append(
            {
                "name": case.name,
                "logits_max_abs": err,
                "kv_max_abs": kv_err,
                "logits_scale": scale,
                "ok": within,
            }
        )
    report = {
        "ok": ok,
        "atol": atol,
        "rtol": rtol,
        "max_abs_logits": max(r["logits_max_abs"] for r in rows),
        "max_abs_kv": max(r["kv_max_abs"] for r in rows),
        "cases": rows,
    }
    if shared:
        report["kv_layout"] = "shared"
    logger.info("verify: ok=%s max_abs_logits=%.3g", ok, report["max_abs_logits"])
    return report


def _in_session_types(session: Any, case: ReferenceCase) -> ReferenceCase:
    """`case` with its float feeds (the float32 past) in the graph's input types (float16)."""
    types = {i.name: i.type for i in session.get_inputs()}
    feeds = dict(case.feeds)
    for name, value in feeds.items():
        if types.get(name) == "tensor(float16)" and value.dtype != np.float16:
            feeds[name] = value.astype(np.float16)
    return dataclasses.replace(case, feeds=feeds)


def _concat_kv_err(case: ReferenceCase, presents: list[np.ndarray]) -> float:
    if case.kv_mask is None:
        return 0.0
    weight = case.kv_mask[:, None, :, None]
    err = 0.0
    for o, r in zip(presents, case.present):
        err = max(err, float((np.abs(o - r) * weight).max(initial=0.0)))
    return err


def run_shared(session: Any, case: ReferenceCase) -> tuple[np.ndarray, float]:
    """Run a (left-padded, concat-layout) case through a shared-layout graph.

    Returns logits [B, S, V] laid out like `case.logits` (real positions filled) and the max
    |present - reference| over real cache slots. Rows are compacted: row b's past real tokens
    fill slots 0..p_b-1 of its buffer and its new real tokens follow, right-padded to the
    longest row (positions p_b + j, as the left-padded reference numbers them). The graph
    tells the kernel min(S, seqlens_k + 1) new tokens per row, so rows of a multi-token case on
    a past run batched when they add the same count (the chunk cases); a branching tree's bias
    (passes/tree_bias.py) also needs the same past length.
    """
    ids = case.feeds["input_ids"]
    batch, seq = ids.shape
    mask = case.kv_mask if case.kv_mask is not None else np.ones((batch, seq), np.int64)
    past_len = mask.shape[1] - seq
    groups = [list(range(batch))]
    if past_len > 0 and seq > 1:
        tree = case.feeds.get(TREE_MASK)
        branching = tree is not None and bool((np.tril(tree) != np.tri(seq, dtype=bool)).any())
        keys: dict[tuple[int, int], list[int]] = {}
        for b in range(batch):
            past = int(mask[b, :past_len].sum()) if branching else 0
            keys.setdefault((int(mask[b, past_len:].sum()), past), []).append(b)
        groups = list(keys.values())
    logits = np.zeros_like(case.logits)
    kv_err = 0.0
    for rows in groups:
        out_logits, err = _shared_step(session, case, rows, mask, past_len)
        for r, b in enumerate(rows):
            new_cols = np.flatnonzero(mask[b, past_len:])
            logits[b, new_cols] = out_logits[r, : len(new_cols)]
        kv_err = max(kv_err, err)
    return logits, kv_err


def _shared_step(
    session: Any, case: ReferenceCase, rows: list[int], mask: np.ndarray, past_len: int
) -> tuple[np.ndarray, float]:
    """One shared-layout run for batch rows `rows`: (logits [R, K, V], kv error)."""
    names = kv_input_names(len(case.present) // 2)
    inputs = {i.name for i in session.get_inputs()}
    past_cols = [np.flatnonzero(mask[b, :past_len]) for b in rows]
    new_cols = [np.flatnonzero(mask[b, past_len:]) for b in rows]
    p = np.array([len(c) for c in past_cols])
    n = np.array([len(c) for c in new_cols])
    width, total = int(n.max()), int((p + n).max())
    length = total + 3  # a buffer longer than needed, as the runtime allocates
    ids = np.zeros((len(rows), width), np.int64)
    index = np.zeros((len(rows), width), np.int64)
    for r, b in enumerate(rows):
        ids[r, : n[r]] = case.feeds["input_ids"][b, new_cols[r]]
        index[r] = np.minimum(np.arange(width), n[r] - 1)
    feeds: dict[str, np.ndarray] = {
        "input_ids": ids,
        SEQLENS: (p + n - 1).astype(np.int32),
        TOTAL: np.array(total, np.int32),
    }
    if "position_ids" in inputs:  # the case's own positions (a tree node's is P + depth)
        pos = (p[:, None] + np.arange(width)[None]).astype(np.int64)
        for r, b in enumerate(rows):
            pos[r, : n[r]] = case.feeds["position_ids"][b, new_cols[r]]
        feeds["position_ids"] = pos
    if TREE_MASK in inputs:  # real tokens keep the case's mask, padding stays causal
        tree = np.repeat(np.tri(width, dtype=np.int64)[None], len(rows), 0)
        for r, b in enumerate(rows):
            cols = new_cols[r]
            tree[r, : n[r], : n[r]] = case.feeds[TREE_MASK][b][np.ix_(cols, cols)]
        feeds[TREE_MASK] = tree
    if LOGITS_INDEX in inputs:
        feeds[LOGITS_INDEX] = index
    for name in names:
        past = case.feeds[name]  # [B, Hkv, P, D], left-padded
        buf = np.zeros((len(rows), past.shape[1], length, past.shape[3]), past.dtype)
        for r, b in enumerate(rows):
            buf[r, :, : p[r]] = past[b][:, past_cols[r]]
        feeds[name] = buf
    out_names = [o.name for o in session.get_outputs()]
    out = dict(zip(out_names, session.run(None, feeds)))
    logits = out["logits"]
    if LOGITS_INDEX not in inputs:  # all S positions came out: keep the real ones in order
        logits = np.take_along_axis(logits, index[:, :, None], axis=1)
    kv_err = 0.0
    for i, ref in enumerate(case.present):
        got = out[f"present.{i // 2}.{'key' if i % 2 == 0 else 'value'}"]
        for r, b in enumerate(rows):
            real = np.flatnonzero(mask[b])
            diff = np.abs(got[r, :, : len(real)] - ref[b][:, real])
            kv_err = max(kv_err, float(diff.max(initial=0.0)))
    return logits, kv_err
