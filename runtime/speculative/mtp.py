"""MTP proposer: the drafts come out of the previous verify run of the MTP graph itself.

An artifact with an MTP branch (``manifest.mtp``) computes, inside the same session run that
scores ``[last token, drafts]``, the greedy accepted prefix length, the bonus token and K new
draft ids from the MTP heads (see ``specport.passes.mtp``). The proposer only carries those
ids to the next step. Under sampling (or a repetition penalty) the host verifies every step
and the in-graph drafts are used only when the graph and the host agree on what was accepted;
they often disagree and the step simply runs without drafts. Under plain greedy decoding the
host would only repeat the graph's argmax, so ``decode_greedy`` trusts the graph and runs a
lean loop (no logits leave the session).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from specport.artifact import Manifest
from specport.errors import InputError
from specport.runtime.kv.seq_cache import SequenceCache
from specport.runtime.speculative.base import Drafts, ProposerBase, stop_reason
from specport.runtime.speculative.metrics import AdaptiveDraftLength, SpecDecodingStats
from specport.runtime.speculative.verify import VerifyResult

logger = logging.getLogger(__name__)


def mtp_info(manifest: Manifest) -> dict[str, Any]:
    """The manifest's MTP record, or an InputError telling how to get one."""
    info = manifest.mtp
    if not info or not info.get("heads"):
        raise InputError(
            "this artifact has no MTP branch (manifest 'mtp' is empty). Train heads with "
            "`specport train-mtp ARTIFACT --heads 3 --data FILE --out DIR` and run DIR, or use "
            "--speculative ngram|draft."
        )
    return info


class MTPProposer(ProposerBase):
    """Holds the K draft ids the graph produced for the position after the accepted prefix."""

    name = "mtp"
    adaptive_default = True  # +0.01-0.09x in the four settings measured (README)
    needs_outputs = True  # the drafts come out of the target's own run
    graph_verifies = True  # the branch computes the greedy accepted prefix and bonus token

    def __init__(self, manifest: Manifest) -> None:
        info = mtp_info(manifest)
        self.manifest = manifest
        self.heads = int(info["heads"])
        out = info["outputs"]
        self.accepted_name = out["accepted"]
        self.bonus_name = out["bonus"]
        self.drafts_name = out["drafts"]
        self.pending: list[int] = []
        self.mismatches = 0

    def start(self, sampling: Any = None, stream: int | None = None) -> None:
        self.reset()

    def reset(self) -> None:
        self.pending = []
        self.mismatches = 0

    def propose(self, context: list[list[int]], num_draft: int) -> Drafts:
        if len(context) != 1:
            raise InputError(f"the MTP proposer runs batch 1, got {len(context)} rows")
        return Drafts.one(self.pending[: max(int(num_draft), 0)])

    def observe(self, outputs: dict[str, np.ndarray], result: VerifyResult) -> None:
        """Keep the graph's new drafts if its acceptance matches the host verifier's."""
        accepted = int(outputs[self.accepted_name].reshape(-1)[0])  # [B] int64
        bonus = int(outputs[self.bonus_name].reshape(-1)[0])  # [B] int64
        drafts = outputs[self.drafts_name].reshape(-1).tolist()  # [B, K] int64
        if accepted == int(result.accepted[0]) and bonus == result.tokens[0][-1]:
            self.pending = [int(t) for t in drafts]
        else:
            self.mismatches += 1
            self.pending = []


@dataclass
class FastDecode:
    """What the greedy MTP loop hands back to the generator (which owns the metrics)."""

    tokens: list[int]
    reason: str
    t_first: float | None


def decode_greedy(
    cache: SequenceCache,  # prefilled with prompt[:-1]
    proposer: MTPProposer,
    last: int,  # the prompt's last token (not in the cache yet)
    budget: int,  # new tokens allowed (max_new_tokens capped by the context window)
    max_new_tokens: int,
    ctx_len: int,  # positions the cache may reach
    num_draft: int,
    eos: set[int],
    on_token: Callable[[int], bool | None] | None,
    stats: SpecDecodingStats,
    controller: AdaptiveDraftLength | None = None,
) -> FastDecode:
    """Greedy MTP decoding that trusts the graph's own verification.

    The graph already takes the argmax of the verified logits, the accepted prefix and the
    bonus token (``passes.mtp``); under greedy decoding without a repetition penalty the host
    would recompute exactly that, so only the three small MTP outputs are read (on concat no
    logits leave the session at all) and the cache keeps the accepted prefix: a length move on
    the shared layout, a view of the presents on concat.
    """
    out_names = mtp_info(proposer.manifest)["outputs"]
    acc_name, bonus_name, drafts_name = (out_names[k] for k in ("accepted", "bonus", "drafts"))
    pending = list(proposer.pending)
    out: list[int] = []
    reason = "length"
    t_first: float | None = None
    tally = [[0] * (k + 1) for k in range(num_draft + 1)]  # [k][a]: steps drafting k, accepting a
    clock = time.perf_counter
    while True:
        pos = cache.length
        room = min(budget - len(out) - 1, ctx_len - 1 - pos)
        k = min(num_draft if controller is None else controller.choose(), room, len(pending))
        fed = [last, *pending[:k]] if k > 0 else [last]
        res = cache.step(fed, logits=False).outputs
        accepted = int(res[acc_name][0])  # [B] int64
        bonus = int(res[bonus_name][0])  # [B] int64
        pending = res[drafts_name][0].tolist()  # [B, K] int64
        cache.keep(pos + accepted + 1)
        tally[k][accepted] += 1
        if controller is not None:
            controller.observe(k, accepted)
        if t_first is None:
            t_first = clock()
        new = fed[1 : accepted + 1]
        new.append(bonus)
        done = False
        for tok in new:
            out.append(tok)
            why = stop_reason(tok, len(out), eos, on_token, budget, max_new_tokens)
            if why is not None:
                reason, done = why, True
                break
        if done:
            break
        last = bonus
    proposer.pending = pending
    for k, row in enumerate(tally):
        for accepted, count in enumerate(row):
            if count:
                stats.observe_draft(k, accepted, count)
    return FastDecode(out, reason, t_first)
