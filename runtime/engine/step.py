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
3. verifies each row's drafts against its scores (``Verifier.chain``), or picks its one
   token when it drafted nothing;
4. commits: keeps each row's KV at its accepted length (rejected drafts and padding are
   rolled back by moving the length, no KV is copied);
5. shows each proposer the verdict and its row's slice of the run's other outputs (an MTP
   branch's drafts come out of the same run).

Nothing here asks which proposer a row has: what differs between proposers is in their
``propose`` and ``observe``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from specport.runtime.kv.cache import KVCache
from specport.runtime.speculative.base import Drafts, Proposer
from specport.runtime.speculative.verify import GREEDY, Verifier, VerifyResult

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
    drafts: Drafts = field(default_factory=lambda: Drafts.empty(1))


@dataclass
class RowVerdict:
    """What a row emits from a step."""

    tokens: list[int]  # accepted drafts + one (its plain token without drafts)
    logits: np.ndarray  # [len(tokens), V] the scores they were chosen from (for logprobs)
    drafted: int
    accepted: int
    error: str | None = None  # its sampler, grammar or verifier failed: it ends alone


def propose(rows: Sequence[StepRow]) -> int:
    """Each row's drafts (``row.drafts``, at most ``row.cap``); returns the most drafted."""
    widest = 0
    for r in rows:
        if r.proposer is None or r.cap <= 0:
            r.drafts = _NONE
            continue
        r.drafts = truncate_drafts(r.proposer.propose([r.context], r.cap), r.cap)
        widest = max(widest, int(r.drafts.lengths[0]))
    return widest


def run(
    cache: KVCache, rows: Sequence[StepRow], width: int, alone: bool = False
) -> list[RowVerdict]:
    """Run the target once over ``rows`` at ``width`` (1 + drafts; drafts past it are cut),
    verify, commit and observe. ``alone``: one row at batch 1 on its own KV view; otherwise
    one run over rows [0, highest row] (rows not in ``rows`` stay as they are)."""
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
        try:
            if drafted == 0:
                greedy = None if out.greedy is None or width != 1 else int(out.greedy[i, 0])
                token = r.pick(logits[:1], greedy)
                result = VerifyResult(_ZERO, [[token]], _TRUE)
            else:
                result = r.verifier.chain(r.drafts, logits[None, : drafted + 1], (r.context,))
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
            r.proposer.observe(_slice(out.outputs, i), result)
        verdicts.append(RowVerdict(result.tokens[0], logits, drafted, accepted))
    return verdicts


def truncate_drafts(drafts: Drafts, k: int) -> Drafts:
    """The first ``k`` drafts of a one-row ``Drafts`` (unchanged when it has no more)."""
    if drafts.width <= k:
        return drafts
    return Drafts(
        drafts.tokens[:, :k],
        np.minimum(drafts.lengths, k),
        None if drafts.probs is None else drafts.probs[:, :k],
    )


def _fed(r: StepRow) -> list[int]:
    return [r.context[-1], *r.drafts.row(0)]


def _slice(outputs: dict[str, np.ndarray], i: int) -> dict[str, np.ndarray]:
    return {name: value[i : i + 1] for name, value in outputs.items()} if outputs else outputs


_NONE = Drafts.empty(1)
_ZERO = np.zeros(1, dtype=np.int64)
_TRUE = np.ones(1, dtype=bool)
