"""Tree speculative decoding: several candidate continuations verified in one target run.

A chain step scores ``[last, d1..dK]`` and keeps the longest agreeing prefix; when the text
could continue in several ways that were all seen before (a word followed by different words
in different places), the chain bets on one of them. A tree step puts every candidate into a
trie under the last emitted token and scores all trie nodes in ONE run of an artifact exported
with ``--tree-mask``: node i sits at position ``P + depth(i)`` and attends the past plus its own
ancestors (``tree_mask[i, j] = 1`` iff j is i or an ancestor of i), so its logits equal those of
a chain run of its root path. Verification walks down from the root while the target agrees
with some child; the accepted path and one more token (the target's) are emitted, and the KV
cache keeps the past plus the accepted path's positions, in order.

A tree is what ``TreeProposer`` drafts (``Drafts.tree``) and the engine's one step runs it
(``engine.step``: one run through the tree mask, the verifier's tree rule,
``KVCache.keep_positions`` keeping the accepted path's positions: moved within the in-place
buffer on the shared layout, gathered from the presents on concat), driven for one prompt by
``engine.driver.generate_rows``.

Candidates come from n-gram matches (``token_tree.ngram_candidates``): every distinct continuation of the
longest suffix n-grams that recur in prompt + output, most recent first (the chain n-gram
proposer keeps only the most recent); or from an MTP artifact's heads
(``runtime.speculative.mtp_tree``): a beam of their top-W tokens per depth, seeded with the
hidden state of the node the previous run accepted (an ``observer`` sees every run's outputs);
or from an EAGLE head (``runtime.speculative.eagle``, ``EagleProposer.tree_paths``): its beam
over the draft vocabulary, fed the features of the path the previous run accepted.

Greedy output is token-for-token the plain greedy output (up to float ties). Sampling is
lossless (multi-round speculative sampling with one-hot drafts). Both rules live with the
other verifiers in ``runtime.speculative.verify`` (``Verifier.tree``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from specport.artifact import Manifest
from specport.contract import TREE_MASK
from specport.errors import InputError
from specport.runtime.engine.driver import generate_rows
from specport.runtime.sampler import SamplingConfig
from specport.runtime.speculative.base import (
    Drafts,
    ProposerBase,
    check_int_range,
)
from specport.runtime.speculative.loop import (
    KVSlot,
    OnToken,
    SessionModel,
    SpeculativeOutput,
    check_num_draft,
)
from specport.runtime.speculative.token_tree import TokenTree, ngram_candidates

logger = logging.getLogger(__name__)

MAX_TREE_WIDTH = 16
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


def generate_tree(
    model: Any,
    prompt_ids: list[int],
    max_new_tokens: int,
    num_draft: int,
    tree_width: int,
    sampling: SamplingConfig | None = None,
    eos_ids: Sequence[int] = (),
    on_token: OnToken | None = None,
    method: str = "ngram",
    slot: KVSlot | None = None,
) -> tuple[list[int], str, dict[str, Any]]:
    """Tree speculative generation for one prompt with a loaded ``specport.api.Model``.

    ``num_draft``: the tree's depth (tokens per candidate); ``tree_width``: how many distinct
    candidates it holds (at most ``1 + num_draft * tree_width`` nodes scored per run), from
    n-gram matches (``method="ngram"``), the MTP heads (``"mtp"``, an MTP artifact) or the
    EAGLE head's beam (``"eagle"``, an artifact from ``train-draft``).
    The artifact must have been exported with ``--tree-mask``. Returns (new tokens, finish
    reason, metrics) with the keys of ``generate_speculative``'s metrics. ``slot``: the
    model's KV kept between calls, as ``generate_speculative`` takes it (a cache of another
    session, e.g. MTP trees' verify graph after a chain call, is not reused).
    """
    from specport.runtime.speculative.exactness import warn_if_not_token_exact

    warn_if_not_token_exact(model.manifest)
    if method == "mtp":
        from specport.runtime.speculative.mtp_tree import mtp_tree_generator

        gen = mtp_tree_generator(model, num_draft, tree_width)
    elif method == "ngram":
        gen = TreeSpeculativeGenerator(model.session, model.manifest, num_draft, tree_width)
    elif method == "eagle":
        from specport.runtime.speculative.eagle import make_eagle_proposer

        head = make_eagle_proposer(model, tree=True)
        gen = TreeSpeculativeGenerator(
            model.session,
            model.manifest,
            num_draft,
            tree_width,
            candidates=head.tree_paths,
            observer=head.observe_path,
            method="eagle-tree",
        )
    else:
        raise InputError(f"token trees take candidates from ngram, mtp or eagle, not {method!r}")
    if slot is not None:  # a cache from the model's last call: its prefix is not prefilled
        gen.last_kv, gen.last_ids = slot.cache, slot.held
        slot.held = None  # the cache changes now: held again only once this call ends
    out = gen.generate(prompt_ids, max_new_tokens, sampling, eos_ids, on_token)
    if slot is not None:
        slot.cache, slot.held = gen.last_kv, gen.last_ids
    out.metrics["provider"] = getattr(model, "provider", None)
    return out.tokens, out.finish_reason, out.metrics
