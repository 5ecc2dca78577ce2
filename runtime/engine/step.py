"""The one decode step: propose -> run the target once -> verify -> commit -> observe.

Every row of a step brings its context (prompt + generated ids; the last one has no KV yet),
optionally a proposer with the verifier chosen once from its request's sampling
(``verify.make_verifier``), and a ``pick`` for the token it emits without drafts (the request's
sampler, or the graph's argmax). The step

1. asks each row's proposer for up to its cap of drafts (``propose``; no proposer, a cap of 0
   or no guess: the row drafts nothing, which is plain decoding);
2. runs the target once over every row's ``[last, drafts]`` padded to the step's width
   (``KVCache.step`` over rows [0, b), or ``step_row`` for a row verifying alone at batch 1,
   the only multi-token shape graphs without batched multi-token attention accept);
3. verifies each row's drafts against its scores and the run's outputs (``Verifier.chain``:
   an MTP branch's in-graph verdict is one of the verifiers), or picks its one token when
   it drafted nothing;
4. commits: keeps each row's KV at its accepted length (rejected drafts and padding are
   rolled back by moving the length, no KV is copied);
5. shows each proposer the verdict and its row's slice of the run's other outputs (an MTP
   branch's drafts come out of the same run).

Drafts that form a token tree (``Drafts.tree``: a trie under the row's last token) run alone
through the graph's tree mask (``step_row(tree=...)``), are verified by the verifier's
``tree`` rule and committed with ``KVCache.keep_positions`` (the accepted path's positions,
in order). Nothing here asks which proposer a row has: what differs between proposers is in
their ``propose`` and ``observe``.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from specport.runtime.kv.interface import KVCache
from specport.runtime.speculative.base import Drafts, Proposer
from specport.runtime.speculative.verify import ARGMAX, GREEDY, Verifier, VerifyResult

logger = logging.getLogger(__name__)

# pick(logits [1, V], greedy id or None) -> the row's next token without drafts
Pick = Callable[[np.ndarray, "int | None"], int]


@dataclass
class StepRow:
    """One row's part in a step."""

    row: int  # its KV row
    context: list[int]  # prompt + generated; the last id has no KV yet
    pick: Pick
    proposer: Proposer | None = None
    verifier: Verifier = GREEDY
    cap: int = 0  # drafts it may verify this step (budget, KV room, the step's width)
    room: int = 1 << 30  # KV positions free past its last token (a tree's nodes must fit)
    drafts: Drafts = field(default_factory=lambda: Drafts.empty(1))


@dataclass
class RowVerdict:
    """What a row emits from a step."""

    tokens: list[int]  # accepted drafts + one (its plain token without drafts)
    logits: np.ndarray  # [len(tokens), V] the scores they were chosen from (for logprobs)
    drafted: int  # a tree's depth
    accepted: int
    error: str | None = None  # its sampler, grammar or verifier failed: it ends alone
    nodes: int = 0  # draft positions scored (a tree's nodes, a chain's drafts)


def propose(rows: Sequence[StepRow]) -> int:
    """Each row's drafts (``row.drafts``, at most ``row.cap``); returns the most drafted."""
    widest = 0
    for r in rows:
        if r.proposer is None or r.cap <= 0:
            r.drafts = _NONE
            continue
        drafts = r.proposer.propose([r.context], r.cap)
        if drafts.tree is None:
            r.drafts = truncate_drafts(drafts, r.cap)
        else:
            r.drafts = drafts if len(drafts.tree) <= r.room + 1 else first_nodes(drafts, r.room)
        widest = max(widest, int(r.drafts.lengths[0]))
    return widest


def run(
    cache: KVCache, rows: Sequence[StepRow], width: int, alone: bool = False
) -> list[RowVerdict]:
    """Run the target once over ``rows`` at ``width`` (1 + drafts; drafts past it are cut),
    verify, commit and observe. ``alone``: one row at batch 1 on its own KV view; otherwise
    one run over rows [0, highest row] (rows not in ``rows`` stay as they are)."""
    if alone and rows[0].drafts.tree is not None:
        return [_run_tree(cache, rows[0])]
    if width == 1:
        return _decode(cache, rows, alone)
    for r in rows:
        if r.drafts.width > width - 1:
            r.drafts = truncate_drafts(r.drafts, width - 1)
    start = [int(cache.lengths[r.row]) for r in rows]
    if alone:
        (only,) = rows
        out = cache.step_row(only.row, np.asarray(_fed(only), dtype=np.int64))
        index = [0]
    else:
        batch = max(r.row for r in rows) + 1
        ids = np.zeros((batch, width), dtype=np.int64)
        live = np.zeros(batch, dtype=bool)
        for r in rows:
            fed = _fed(r)
            ids[r.row] = fed + [fed[0]] * (width - len(fed))
            live[r.row] = True
        out = cache.step(ids, live)
        index = [r.row for r in rows]
    verdicts = []
    for r, i, pos in zip(rows, index, start):
        logits = out.logits[i]  # [width, V]
        drafted = int(r.drafts.lengths[0])
        outputs = out.outputs if alone else _slice(out.outputs, i)
        try:
            if drafted == 0:
                greedy = None if out.greedy is None else int(out.greedy[i, 0])
                token = r.pick(logits[:1], greedy)
                result = VerifyResult(_ZERO, [[token]], _TRUE)
            else:  # the graph's argmax at the fed positions, where it has one (``ARGMAX``)
                seen = outputs if out.greedy is None else {**outputs, ARGMAX: out.greedy[i : i + 1]}
                result = r.verifier.chain(r.drafts, logits[None, : drafted + 1], (r.context,), seen)
        except Exception as exc:
            logger.debug("row %d failed", r.row, exc_info=True)
            if width > 1:
                cache.keep(r.row, pos + 1)
            verdicts.append(RowVerdict([], logits, drafted, 0, f"{type(exc).__name__}: {exc}"))
            continue
        accepted = int(result.accepted[0])
        if width > 1:
            cache.keep(r.row, pos + accepted + 1)  # rejected drafts and padding: rolled back
        if r.proposer is not None:
            r.proposer.observe(outputs, result)
        verdicts.append(RowVerdict(result.tokens[0], logits, drafted, accepted, nodes=drafted))
    return verdicts


def _decode(cache: KVCache, rows: Sequence[StepRow], alone: bool) -> list[RowVerdict]:
    """A step of width 1 (no row drafted, or none has room to verify): each row feeds its
    last token and picks one from its own scores. Nothing is verified or rolled back, so no
    drafts are built, no KV is kept back and the graph's argmax is read once for all rows; a
    proposer still observes its row's (empty) verdict. This is plain decoding's whole step,
    so its host work is kept to what the run itself needs (``benchmarks.plain_paths``)."""
    if alone:
        (only,) = rows
        out = cache.step_row(only.row, np.array([only.context[-1]], dtype=np.int64))
        index: Sequence[int] = (0,)
    else:
        index = [r.row for r in rows]
        batch = max(index) + 1
        ids = np.zeros((batch, 1), dtype=np.int64)
        live = np.zeros(batch, dtype=bool)
        ids[index, 0] = [r.context[-1] for r in rows]
        live[index] = True
        out = cache.step(ids, live)
    greedy = None if out.greedy is None else out.greedy[:, 0].tolist()
    verdicts = []
    for r, i in zip(rows, index):
        logits = out.logits[i]  # [1, V]
        try:
            token = r.pick(logits, None if greedy is None else greedy[i])
        except Exception as exc:
            logger.debug("row %d failed", r.row, exc_info=True)
            verdicts.append(RowVerdict([], logits, 0, 0, f"{type(exc).__name__}: {exc}"))
            continue
        if r.proposer is not None:  # drafts it had no room for this step are dropped
            r.drafts = _NONE
            outputs = out.outputs if alone else _slice(out.outputs, i)
            r.proposer.observe(outputs, VerifyResult(_ZERO, [[token]], _TRUE))
        verdicts.append(RowVerdict([token], logits, 0, 0))
    return verdicts


def _run_tree(cache: KVCache, r: StepRow) -> RowVerdict:
    """One row's token tree: one run through the tree mask, the verifier's tree rule, the
    accepted path's positions kept in order (a path that is a prefix of the node order, a
    chain, is a cut)."""
    tree = r.drafts.tree
    pos = int(cache.lengths[r.row])
    tokens, depths, ancestors = tree.flatten()
    out = cache.step_row(r.row, tokens, tree=(depths, ancestors))
    logits = out.logits[0]  # [N, V] one row per node
    try:
        path, extra = r.verifier.tree(tree, logits, r.context)
    except Exception as exc:
        logger.debug("row %d failed", r.row, exc_info=True)
        cache.keep(r.row, pos + 1)
        return RowVerdict([], logits, tree.max_depth, 0, f"{type(exc).__name__}: {exc}")
    keep_path(cache, r.row, pos, path)
    emitted = [*(tree.tokens[i] for i in path[1:]), extra]
    accepted = len(path) - 1
    result = VerifyResult(np.array([accepted]), [emitted], np.array([False]), [path])
    if r.proposer is not None:
        r.proposer.observe(out.outputs, result)
    return RowVerdict(emitted, logits[path], tree.max_depth, accepted, nodes=len(tree) - 1)


def truncate_drafts(drafts: Drafts, k: int) -> Drafts:
    """The first ``k`` drafts of a one-row ``Drafts`` (unchanged when it has no more)."""
    if drafts.width <= k:
        return drafts
    return Drafts(
        drafts.tokens[:, :k],
        np.minimum(drafts.lengths, k),
        None if drafts.probs is None else drafts.probs[:, :k],
    )


def keep_path(cache: KVCache, row: int, pos: int, path: list[int]) -> None:
    """Keep row ``row``'s past ``pos`` positions plus a tree's accepted nodes, in path
    order: a path that is a prefix of the node order (a chain) is a cut, any other path keeps
    exactly those positions."""
    if path == list(range(len(path))):
        cache.keep(row, pos + len(path))
    else:
        cache.keep_positions(row, np.concatenate([np.arange(pos), pos + np.asarray(path)]))


def first_nodes(drafts: Drafts, n: int) -> Drafts:
    """A tree's first ``n`` draft nodes (parents precede children: still a tree), for a tree
    that would not fit in its row's KV."""
    tree = copy.copy(drafts.tree)
    keep = n + 1  # the root and n nodes
    tree.tokens, tree.parents, tree.depths = (
        tree.tokens[:keep], tree.parents[:keep], tree.depths[:keep]
    )  # fmt: skip
    tree.children = [{t: c for t, c in ch.items() if c < keep} for ch in tree.children[:keep]]
    cut = Drafts.one(tree.tokens[1:])
    cut.tree = tree if keep > 1 else None
    return cut


def _fed(r: StepRow) -> list[int]:
    return [r.context[-1], *r.drafts.row(0)]


def _slice(outputs: dict[str, np.ndarray], i: int) -> dict[str, np.ndarray]:
    return {name: value[i : i + 1] for name, value in outputs.items()} if outputs else outputs


_NONE = Drafts.empty(1)
_ZERO = np.zeros(1, dtype=np.int64)
_TRUE = np.ones(1, dtype=bool)
