"""Batch-1 speculative generation: draft K tokens, score [last, drafts] in one run, keep a prefix.

``SpeculativeGenerator`` holds what a caller keeps between generations (the proposer, the
draft length and whether it adapts, the KV cache) and runs each generation through the
engine's one step (``engine.driver.generate_rows`` over a batch of one), the code that also
decodes several prompts and serves requests, on either KV layout (``kv.cache.open_kv_cache``).
Each step feeds the last emitted token and up to K drafts, verifies them
(``runtime.speculative.verify``: greedy exact, lossless rejection sampling, or an MTP graph's
own verdict), emits ``accepted + 1`` tokens and keeps ``P + accepted + 1`` cached positions.

The prompt is prefilled without its last token, so the first step already carries drafts and
every method (n-gram, suffix, draft model, MTP graph, EAGLE) goes through the same step. Greedy
output is token-for-token the plain greedy output (up to float ties, where batched and
single-token matmuls may round differently).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from specport.artifact.manifest import Manifest
from specport.core.errors import InputError
from specport.runtime.engine.driver import generate_rows
from specport.runtime.engine.step_cost import LiveVerifyCosts
from specport.runtime.sampler import SamplingConfig
from specport.runtime.speculative.base import Proposer, adopt, check_int_range
from specport.runtime.speculative.draft import DraftModelProposer
from specport.runtime.speculative.metrics import SpecDecodingStats
from specport.runtime.speculative.mtp import MTPProposer

logger = logging.getLogger(__name__)

MAX_DRAFT = 16
METHODS = ("ngram", "suffix", "draft", "mtp", "eagle", "auto")

# on_token(token_id) -> True to stop generation here (e.g. a stop string matched)
OnToken = Callable[[int], "bool | None"]


@dataclass
class SpeculativeOutput:
    tokens: list[int]  # new tokens (EOS included when it ended generation)
    finish_reason: str  # "eos" | "length" | "stop" | "context"
    metrics: dict[str, Any] = field(default_factory=dict)
    stats: SpecDecodingStats = field(default_factory=SpecDecodingStats)


def check_num_draft(num_draft: int, limit: int = MAX_DRAFT) -> int:
    return check_int_range(num_draft, "--num-draft", limit)


class SpeculativeGenerator:
    """Batch-1 speculative generation over a session that follows the artifact I/O contract
    (either KV layout): the engine's one step over a batch of one, its cache kept for the next
    generation."""

    def __init__(
        self,
        session: Any,
        manifest: Manifest,
        proposer: Proposer,
        num_draft: int,
        adaptive: bool | None = None,
        fast: bool = True,
    ) -> None:
        self.session = session
        self.manifest = manifest
        self.proposer = adopt(proposer)
        self.num_draft = check_num_draft(num_draft)
        self.adaptive = default_adaptive(proposer) if adaptive is None else bool(adaptive)
        self.fast = fast  # greedy MTP: trust the graph's own verification (``GraphVerifier``)
        self.last_kv: Any = None  # the KV after the last generation (reused by the next)
        self.last_ids: list[int] | None = None  # the ids whose KV ``last_kv`` holds
        # the model's measured verify costs and their tracker (``engine.step_cost.
        # live_verify_costs``): what the adaptive draft length weighs under greedy decoding
        self.live_costs: LiveVerifyCosts | None = None

    def generate(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        sampling: SamplingConfig | None = None,
        eos_ids: Sequence[int] = (),
        on_token: OnToken | None = None,
    ) -> SpeculativeOutput:
        """The engine's one step over a batch of one (its cache reused)."""
        held, self.last_ids = self.last_ids, None  # the cache changes now: held once it ends
        out = generate_rows(
            SessionModel(self.session, self.manifest),
            [prompt],
            max_new_tokens,
            lambda: self.proposer,
            self.num_draft,
            sampling,
            eos_ids,
            None if on_token is None else (lambda row, tok: on_token(tok)),
            self.adaptive,
            self.proposer.name,
            cache=self.last_kv,
            graph_verify=self.fast,
            held=held,
            live_costs=self.live_costs,
        )
        self.last_kv, self.last_ids = out.cache, out.held
        out.metrics["speculative"].pop("rows", None)  # one row: the totals are its own
        return SpeculativeOutput(out.tokens[0], out.finish_reasons[0], out.metrics, out.stats[0])


@dataclass
class KVSlot:
    """A model's KV cache kept between speculative calls and the ids its row holds (None:
    nothing reusable, e.g. after a call that did not finish)."""

    cache: Any = None
    held: list[int] | None = None


class SessionModel:
    """What the driver reads of a loaded model (session, manifest, path), for the generators
    made from a bare session."""

    def __init__(self, session: Any, manifest: Manifest) -> None:
        self.session, self.manifest, self.path = session, manifest, None


def make_proposer(
    method: str, model: Any, num_draft: int, draft_model: Any | None = None
) -> Proposer:
    """The proposer for ``method`` (``ngram`` | ``suffix`` | ``draft`` | ``mtp``), validated
    against the target."""
    from specport.runtime.speculative.exactness import warn_if_not_token_exact

    warn_if_not_token_exact(model.manifest)
    if method == "ngram":
        from specport.runtime.speculative.ngram import NgramProposer

        return NgramProposer(min_n=1, max_n=4, max_draft=num_draft)
    if method == "suffix":  # the model's corpus of earlier outputs, shared by every request
        from specport.runtime.speculative.suffix import SuffixProposer

        return SuffixProposer(model.suffix_index, max_draft=num_draft)
    if method == "draft":
        if draft_model is None:
            raise InputError(
                "--speculative draft needs a draft model: pass --draft ARTIFACT (e.g. one made with "
                "`specport export MODEL --layers 1 --out DRAFT`)."
            )
        return DraftModelProposer(
            draft_model.session, draft_model.manifest, model.manifest.vocab_size
        )
    if method == "mtp":
        proposer = MTPProposer(model.manifest)
        model.ensure_mtp_branch()  # `specport.load` leaves the branch out unless asked
        if num_draft > proposer.heads:
            raise InputError(
                f"--num-draft {num_draft} exceeds the artifact's {proposer.heads} MTP heads; "
                f"use --num-draft 1..{proposer.heads}."
            )
        return proposer
    if method == "eagle":  # the artifact's EAGLE head (`specport train-draft`)
        from specport.runtime.speculative.eagle import make_eagle_proposer

        return make_eagle_proposer(model)
    if method == "auto":  # suffix matching + the artifact's drafter, sized from measured costs
        from specport.runtime.speculative.hybrid import make_hybrid_proposer

        return make_hybrid_proposer(model, num_draft, draft_model)
    raise InputError(
        f"unknown --speculative method {method!r}; choose one of {', '.join(METHODS)}."
    )


def proposer_factory(
    method: str, model: Any, num_draft: int, draft: Any = None
) -> tuple[Proposer, Callable[[], Proposer]]:
    """The first proposer (made now, so a bad method or drafter fails before any work) and a
    factory that hands it out first, then makes one per further row."""
    first = make_proposer(method, model, num_draft, draft)
    pool = [first]

    def make() -> Proposer:
        return pool.pop() if pool else make_proposer(method, model, num_draft, draft)

    return first, make


def generate_in_slot(
    gen: Any,  # SpeculativeGenerator | TreeSpeculativeGenerator
    slot: KVSlot | None,
    model: Any,
    prompt_ids: list[int],
    max_new_tokens: int,
    sampling: SamplingConfig | None,
    eos_ids: Sequence[int],
    on_token: OnToken | None,
) -> tuple[list[int], str, dict[str, Any]]:
    """`gen.generate` on the cache `slot` keeps from the model's last call (its prefix is not
    prefilled again), leaving the cache there for the next; None: a fresh cache.
    Returns (new tokens, finish reason, metrics with the model's provider)."""
    if slot is not None:
        gen.last_kv, gen.last_ids = slot.cache, slot.held
        slot.held = None  # the cache changes now: held again only once this call ends
    out = gen.generate(prompt_ids, max_new_tokens, sampling, eos_ids, on_token)
    if slot is not None:
        slot.cache, slot.held = gen.last_kv, gen.last_ids
    out.metrics["provider"] = getattr(model, "provider", None)
    return out.tokens, out.finish_reason, out.metrics


def default_adaptive(proposer: Proposer) -> bool:
    """Whether adaptive draft length is on by default for this proposer (chosen by measurement)."""
    return adopt(proposer).adaptive_default


def generate_speculative(
    model: Any,
    prompt_ids: list[int],
    max_new_tokens: int,
    method: str,
    num_draft: int,
    draft_model: Any | None = None,
    sampling: SamplingConfig | None = None,
    eos_ids: Sequence[int] = (),
    on_token: OnToken | None = None,
    adaptive: bool | None = None,
    slot: KVSlot | None = None,
) -> tuple[list[int], str, dict[str, Any]]:
    """Speculative generation for one prompt with a loaded ``specport.api.Model``.

    ``method``: ``ngram`` | ``draft`` (needs ``draft_model``, same vocabulary) | ``mtp`` (needs
    an artifact with MTP heads). ``adaptive``: choose the draft length per step (at most
    ``num_draft``) from recent acceptance per position (``metrics.AdaptiveDraftLength``); None
    takes the proposer's measured default (``adaptive_default``: on for draft and MTP); under
    greedy decoding it weighs the verify costs measured on this machine, corrected by its timed
    steps (``engine.step_cost.live_verify_costs``, as ``auto`` does), so a drafter that does
    not pay leaves the steps plain. Returns (new tokens,
    finish reason, metrics); metrics carry the plain generator's timing keys plus
    ``speculative`` (acceptance counters).
    """
    num_draft = check_num_draft(num_draft)
    proposer = make_proposer(method, model, num_draft, draft_model)
    gen = SpeculativeGenerator(model.session, model.manifest, proposer, num_draft, adaptive)
    if gen.adaptive and (sampling is None or sampling.greedy):
        from specport.runtime.engine.step_cost import live_verify_costs

        gen.live_costs = live_verify_costs(model)
    return generate_in_slot(
        gen, slot, model, prompt_ids, max_new_tokens, sampling, eos_ids, on_token
    )
