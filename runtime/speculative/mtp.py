"""MTP proposer: the drafts come out of the previous verify run of the MTP graph itself.

An artifact with an MTP branch (``manifest.mtp``) computes, inside the same session run that
scores ``[last token, drafts]``, the greedy accepted prefix length, the bonus token and K new
draft ids from the MTP heads (see ``specport.passes.mtp``). The proposer only carries those
ids to the next step. Under plain greedy decoding the step trusts the graph's verdict
(``verify.GraphVerifier``, chosen by ``make_verifier``); under sampling (or a repetition
penalty) the host verifies every step and the in-graph drafts are used only when the graph and
the host agree on what was accepted; they often disagree and the step simply runs without
drafts.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from specport.artifact.manifest import Manifest
from specport.core.errors import InputError
from specport.runtime.speculative.base import Drafts, ProposerBase
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

    def start(
        self, sampling: Any = None, stream: int | None = None, budget: int | None = None
    ) -> None:
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
