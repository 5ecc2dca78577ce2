"""Batch-1 speculative generation: draft K tokens, score [last, drafts] in one run, keep a prefix.

On a ``shared``-layout artifact ``SpeculativeGenerator`` drives the engine's one step
(``engine.driver.generate_rows``, a batch of one), the same code that decodes several prompts
and serves requests. The ``concat`` layout (past in, present out; models whose head dimension
onnxruntime's fused attention refuses, Optimum-format artifacts) keeps the loop below until it
sits behind the KV interface: each step feeds the last emitted token and up to K drafts at
positions P..P+K on top of the sequence's cache (``runtime.kv.seq_cache.ConcatCache``),
verifies them (``runtime.speculative.verify``: greedy exact, lossless rejection sampling, or an
MTP graph's own verdict), emits ``accepted + 1`` tokens and keeps ``P + accepted + 1`` cached
positions (a view of the presents).

The prompt is prefilled without its last token, so the first step already carries drafts and
every method (n-gram, suffix, draft model, MTP graph, EAGLE) goes through the same step. Greedy
output is token-for-token the plain greedy output (up to float ties, where batched and
single-token matmuls may round differently).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from specport.artifact import Manifest
from specport.contract import TREE_MASK
from specport.errors import InputError
from specport.runtime.engine.driver import generate_rows
from specport.runtime.kv.seq_cache import ConcatCache, context_limit
from specport.runtime.sampler import Sampler, SamplingConfig
from specport.runtime.speculative.base import (
    Drafts,
    Proposer,
    adopt,
    check_int_range,
    check_prompts,
    stop_reason,
)
from specport.runtime.speculative.draft import DraftModelProposer
from specport.runtime.speculative.metrics import (
    AdaptiveDraftLength,
    SpecDecodingStats,
    timing_metrics,
)
from specport.runtime.speculative.mtp import MTPProposer
from specport.runtime.speculative.verify import graph_outputs, make_verifier

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
    """Batch-1 speculative generation over a session that follows the artifact I/O contract."""

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
        self.last_kv: Any = None  # the KV after the last generation (shared: reused by the next)

    def generate(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        sampling: SamplingConfig | None = None,
        eos_ids: Sequence[int] = (),
        on_token: OnToken | None = None,
    ) -> SpeculativeOutput:
        if self.manifest.kv.layout == "shared":
            return self._driven(prompt, max_new_tokens, sampling, eos_ids, on_token)
        vocab = self.manifest.vocab_size
        prompt = check_prompts([prompt], max_new_tokens, context_limit(self.manifest), vocab)[0]
        sampling = sampling or SamplingConfig()
        sampler = Sampler(sampling, vocab)
        proposer = self.proposer
        proposer.start(sampling)
        graph = graph_outputs(self.manifest) if self._graph_verifies() else None
        verifier = make_verifier(sampler, graph)  # chosen once per request
        ctx_len = context_limit(self.manifest)
        budget = min(max_new_tokens, ctx_len - len(prompt))
        eos = {int(e) for e in eos_ids}
        stats = SpecDecodingStats()
        cache = ConcatCache(self.session, self.manifest)
        propose_s = 0.0

        t_start = time.perf_counter()
        if len(prompt) > 1:  # prefill all but the last token; its logits are not needed
            cache.step(prompt[:-1], last_only=True)
        t_prefill = time.perf_counter()
        prefill_ort = cache.ort_seconds

        controller = self._controller() if self.adaptive else None
        # Timings steer K only under greedy decoding, where K cannot change the output; with
        # sampling K decides how the random stream is consumed, so a seeded run must not
        # depend on the clock (the cost model then keeps its static prior).
        timed = sampler.config.greedy
        context = list(prompt)
        out: list[int] = []
        reason = "length"
        t_first: float | None = None
        done = False
        per_draft = proposer.draft_cost(self.manifest) > 0
        last_step: tuple[int, float, float] | None = None  # (k, start, propose seconds)
        while not done:
            pos = cache.length  # == len(context) - 1: the last token is not in the cache yet
            room = min(budget - len(out) - 1, ctx_len - 1 - pos)
            k = min(self.num_draft if controller is None else controller.choose(), room)
            t0 = time.perf_counter()
            if controller is not None and timed and last_step is not None:  # the previous step
                k_prev, t_prev, propose_prev = last_step
                controller.observe_cost(k_prev, propose_prev, t0 - t_prev - propose_prev, per_draft)
            drafts = proposer.propose([context], k) if k > 0 else Drafts.empty(1)
            if drafts.width > k:
                drafts = Drafts(
                    drafts.tokens[:, :k],
                    np.minimum(drafts.lengths, k),
                    None if drafts.probs is None else drafts.probs[:, :k],
                )
            t1 = time.perf_counter()
            propose_s += t1 - t0
            fed = [context[-1], *drafts.row(0)]
            step = cache.step(fed)
            last_step = (k, t0, t1 - t0)
            logits = step.logits[None, : len(fed)]  # [1, S, V]
            result = verifier.chain(drafts, logits, (context,), step.outputs)
            cache.keep(pos + int(result.accepted[0]) + 1)  # rollback: a view of the presents
            proposer.observe(step.outputs, result)
            stats.observe(drafts, result)
            if controller is not None:
                controller.observe(int(drafts.lengths[0]), int(result.accepted[0]))
            if t_first is None:
                t_first = time.perf_counter()
            for tok in result.tokens[0]:
                out.append(tok)
                context.append(tok)
                why = stop_reason(tok, len(out), eos, on_token, budget, max_new_tokens)
                if why is not None:
                    reason, done = why, True
                    break
        t_end = time.perf_counter()
        self.last_kv = cache  # the cache after the final step (tests compare it to plain decoding)
        stats.log()
        clock = {"start": t_start, "prefill": t_prefill, "first": t_first, "end": t_end}
        metrics: dict[str, Any] = {
            **timing_metrics(
                len(prompt),
                len(out),
                stats.num_steps,
                clock,
                cache.ort_seconds,
                prefill_ort,
                propose_s,
            ),
            "kv_layout": self.manifest.kv.layout,
            "speculative": {
                "method": proposer.name,
                "num_draft": self.num_draft,
                "adaptive": self.adaptive,
                **stats.as_dict(),
            },
        }
        return SpeculativeOutput(out, reason, metrics, stats)

    def _driven(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        sampling: SamplingConfig | None,
        eos_ids: Sequence[int],
        on_token: OnToken | None,
    ) -> SpeculativeOutput:
        """The shared layout: the engine's one step over a batch of one (its cache reused)."""
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
        )
        self.last_kv = out.cache
        out.metrics["speculative"].pop("rows", None)  # one row: the totals are its own
        return SpeculativeOutput(out.tokens[0], out.finish_reasons[0], out.metrics, out.stats[0])

    def _controller(self) -> AdaptiveDraftLength:
        """The adaptive-K controller with a static prior on what a draft costs."""
        ctl = AdaptiveDraftLength(self.num_draft)
        cost = self.proposer.draft_cost(self.manifest)  # e.g. one draft-model run per draft
        if cost > 0:
            ctl.cost_per_draft += cost
            ctl.prior_cost = ctl.cost_per_draft
        return ctl

    def _graph_verifies(self) -> bool:
        """The proposer's drafts are verified in the graph (an MTP branch) and the caller
        trusts it (``fast``); a tree-mask graph's branch is not used for chains."""
        plain_inputs = TREE_MASK not in {i.name for i in self.session.get_inputs()}
        return self.fast and self.proposer.graph_verifies and plain_inputs


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
) -> tuple[list[int], str, dict[str, Any]]:
    """Speculative generation for one prompt with a loaded ``specport.api.Model``.

    ``method``: ``ngram`` | ``draft`` (needs ``draft_model``, same vocabulary) | ``mtp`` (needs
    an artifact with MTP heads). ``adaptive``: choose the draft length per step (at most
    ``num_draft``) from recent acceptance per position (``metrics.AdaptiveDraftLength``); None
    takes the proposer's measured default (``adaptive_default``: on for draft and MTP). Returns (new tokens,
    finish reason, metrics); metrics carry the plain generator's timing keys plus
    ``speculative`` (acceptance counters).
    """
    num_draft = check_num_draft(num_draft)
    proposer = make_proposer(method, model, num_draft, draft_model)
    gen = SpeculativeGenerator(model.session, model.manifest, proposer, num_draft, adaptive)
    out = gen.generate(prompt_ids, max_new_tokens, sampling, eos_ids, on_token)
    out.metrics["provider"] = getattr(model, "provider", None)
    return out.tokens, out.finish_reason, out.metrics
