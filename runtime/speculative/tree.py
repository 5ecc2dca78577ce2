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

A tree is what ``tree_generator.TreeProposer`` drafts (``Drafts.tree``) and the engine's one
step runs it (``engine.step``: one run through the tree mask, the verifier's tree rule,
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

The proposer and the batch-of-one generator are ``tree_generator``'s (below this module and the
candidate sources that build on it, ``mtp_tree``); this module picks the candidates by method.

Greedy output is token-for-token the plain greedy output (up to float ties). Sampling is
lossless (multi-round speculative sampling with one-hot drafts). Both rules live with the
other verifiers in ``runtime.speculative.verify`` (``Verifier.tree``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from specport.core.errors import InputError
from specport.runtime.sampler import SamplingConfig
from specport.runtime.speculative.exactness import warn_if_not_token_exact
from specport.runtime.speculative.loop import KVSlot, OnToken, generate_in_slot
from specport.runtime.speculative.mtp_tree import mtp_tree_generator
from specport.runtime.speculative.tree_generator import TreeSpeculativeGenerator

logger = logging.getLogger(__name__)


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
    warn_if_not_token_exact(model.manifest)
    if method == "mtp":
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
    return generate_in_slot(
        gen, slot, model, prompt_ids, max_new_tokens, sampling, eos_ids, on_token
    )
