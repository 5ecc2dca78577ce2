"""The token-tree proposer and the batch-of-one tree generator (``tree``'s docstring explains
token trees): candidates in, a ``Drafts.tree`` out, verified by the engine's one step.

Below ``tree`` (which picks the candidate source by method) and the sources that build on it
(``mtp_tree``), so that neither of those imports the other.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from specport.artifact.manifest import Manifest
from specport.core.contract import MAX_TREE_WIDTH, TREE_MASK
from specport.core.errors import InputError
from specport.runtime.engine.driver import generate_rows
from specport.runtime.sampler import SamplingConfig
from specport.runtime.speculative.base import (
    Drafts,
    ProposerBase,
    check_int_range,
)
from specport.runtime.speculative.loop import (
    OnToken,
    SessionModel,
    SpeculativeOutput,
    check_num_draft,
)
from specport.runtime.speculative.token_tree import TokenTree, ngram_candidates

METHOD = "ngram-tree"

# candidates(context, depth, width) -> up to `width` continuations of up to `depth` tokens,
# best first (earlier candidates win node slots and are tried first when sampling)
CandidateSource = Callable[[list[int], int, int], list[list[int]]]
# observer(outputs, path): a run's extra graph outputs and the rows of the nodes it accepted,
# from the root ([0] for a run without a tree); a stateful candidate source reads what it
# needs from them
RunObserver = Callable[[dict[str, np.ndarray], list[int]], None]


def has_tree_mask(session: Any) -> bool:
    return any(i.name == TREE_MASK for i in session.get_inputs())


def check_tree_width(tree_width: int, limit: int = MAX_TREE_WIDTH) -> int:
    return check_int_range(tree_width, "--tree-width", limit)


class TreeProposer(ProposerBase):
    """Drafts a token tree (``Drafts.tree``) of up to ``width`` candidates from ``candidates``,
    as deep as the step's cap; ``observer`` sees every run's outputs and the path of nodes it
    accepted (the root alone when the run had no tree)."""

    def __init__(
        self,
        width: int,
        candidates: CandidateSource,
        observer: RunObserver | None = None,
        name: str = METHOD,
    ) -> None:
        self.width = check_tree_width(width)
        self.candidates = candidates
        self.observer = observer
        self.name = name
        self.needs_outputs = observer is not None

    def propose(self, context: list[list[int]], num_draft: int) -> Drafts:
        (ctx,) = context
        depth = max(int(num_draft), 0)
        tree = TokenTree(ctx[-1], 1 + depth * self.width)
        if depth > 0:
            for cand in self.candidates(ctx, depth, self.width):
                tree.add(cand[:depth])
        if len(tree) == 1:
            return Drafts.one([])  # nothing to guess: a plain step
        drafts = Drafts.one(tree.tokens[1:])
        drafts.tree = tree
        return drafts

    def observe(self, outputs: dict[str, np.ndarray], result: Any) -> None:
        if self.observer is not None:
            self.observer(outputs, list(result.paths[0]) if result.paths else [0])


class TreeSpeculativeGenerator:
    """Batch-1 tree speculative generation over a session exported with ``--tree-mask``
    (either KV layout)."""

    def __init__(
        self,
        session: Any,
        manifest: Manifest,
        num_draft: int,
        tree_width: int,
        min_n: int = 1,
        max_n: int = 4,
        candidates: CandidateSource | None = None,
        observer: RunObserver | None = None,
        method: str = METHOD,
    ) -> None:
        """``candidates`` replaces the n-gram source (e.g. MTP top-k, or an oracle in tests)."""
        if not has_tree_mask(session):
            raise InputError(
                "tree speculative decoding needs an artifact with a 'tree_mask' input; re-export "
                "the model with `specport export MODEL --out DIR --tree-mask`, or use chain "
                "speculative decoding (tree width 1) on this artifact."
            )
        self.session = session
        self.manifest = manifest
        self.num_draft = check_num_draft(num_draft)
        self.tree_width = check_tree_width(tree_width)
        self.candidates: CandidateSource = candidates or (
            lambda ctx, depth, width: ngram_candidates(ctx, depth, width, min_n, max_n)
        )
        self.observer = observer
        self.method = method
        self.last_kv: Any = None  # the KV after the last generation (reused by the next)
        self.last_ids: list[int] | None = None  # the ids whose KV ``last_kv`` holds

    def generate(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        sampling: SamplingConfig | None = None,
        eos_ids: Sequence[int] = (),
        on_token: OnToken | None = None,
    ) -> SpeculativeOutput:
        """The engine's one step over a batch of one, drafting trees (its cache reused: a
        prompt that continues the last call's ids prefills only what follows them)."""
        proposer = TreeProposer(self.tree_width, self.candidates, self.observer, self.method)
        held, self.last_ids = self.last_ids, None  # the cache changes now: held once it ends
        out = generate_rows(
            SessionModel(self.session, self.manifest),
            [prompt],
            max_new_tokens,
            lambda: proposer,
            self.num_draft,
            sampling,
            eos_ids,
            None if on_token is None else (lambda row, tok: on_token(tok)),
            method=self.method,
            session=self.session,
            cache=self.last_kv,
            tree_width=self.tree_width,
            held=held,
        )
        self.last_kv, self.last_ids = out.cache, out.held
        out.metrics["speculative"].pop("rows", None)  # one row: the totals are its own
        return SpeculativeOutput(out.tokens[0], out.finish_reasons[0], out.metrics, out.stats[0])
