"""The hybrid proposer behind ``--speculative auto``: per step, the draft that pays most.

A model drafter (the artifact's EAGLE head, its MTP heads, or a draft model) guesses a little
everywhere; suffix matching (the request's own text and earlier answers, ``suffix.py``) guesses
nothing most of the time and long runs where text repeats. Each step the hybrid weighs what it
has, by **expected tokens per unit of step cost**, and drafts with the best:

* **acceptance, calibrated per source and draft position**: one ``AdaptiveDraftLength`` per
  source (the model; suffix matches in the request's own text and in earlier answers, each
  split by match length: a 1-token match in random text is no 6-token match in a loop), each
  a running estimate of P(draft i accepted | drafts before it accepted). The
  model's starts from the held-out acceptance its training measured (the manifest's
  ``eagle.training``), the others from priors. Every draft made is scored against the tokens
  the target goes on to emit, over as many later steps as it takes to reach its end or its
  first miss: a suffix match is free to compute, so it is scored every step, used or not, at
  every position (a plain step reveals one token, the next steps the rest); under sampling a
  draft token equals the emitted one with the probability that rejection sampling accepts
  it, so the estimate stays unbiased. The model is scored when it ran;
* **cost, measured**: verifying k drafts costs ``engine.step_cost.verify_costs(model)[k]``
  plain steps (measured once per machine and artifact; under greedy decoding corrected by the
  steps' own times, ``LiveVerifyCosts``), plus what the drafter costs per draft (its prior,
  ``draft_cost``; under greedy decoding, its timed runs against the timed rest of the step).
  Steps are timed by the tracker's clock: process CPU time on the CPU provider, so a machine
  with more runnable threads than cores does not make drafts look dear.

Before a request's first step, its prompt is profiled (``prompt_profile``): own-text drafting
replayed over the prompt's latest tokens adds what this request's text measures to the
own-text estimates, and only a request whose prompt copies well (a passage, or own-text
matches that came true) may draft past ``OPEN_DRAFT`` tokens per step.

A draft model must read the text before it drafts: the whole prompt at a request's first
model draft, and whatever it missed while other sources drafted. That reading is a prefill on
the draft (a 4-bit SmolLM2 reads a 769-token article in 2.6 s on 2 AVX2 cores, slower than its
fp32 target), paid once and repaid only by the steps that follow, so the model drafts only
where what it is expected to save over the answer's remaining tokens (at most the request's
budget, ``ANSWER_PRIOR`` when unknown, ``ANSWER_CAP`` at most) exceeds the reading's cost
(timed per token read, under greedy decoding; ``READ_PRIOR`` of a draft run per token before).

The candidates are plain decoding (value 1), the suffix draft at its best length, and the
model's draft at its best length (run only when it wins: an EAGLE head that would not pay is
not run); a model draft is extended by a suffix match of the text it would make when that
adds value. When nothing beats 1 the step decodes plainly, so text where no source guesses
(random tokens) pays only the occasional probe of a source whose estimate drifted back up.

Under greedy decoding the estimates are shared by every request of a loaded model (they keep
learning across a conversation or a benchmark); under sampling each request starts from the
priors and never reads the clock, so a seeded request decodes the same tokens every time.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from specport.runtime.engine.step_cost import LiveVerifyCosts, live_verify_costs
from specport.runtime.speculative.base import Drafts, Proposer, ProposerBase
from specport.runtime.speculative.draft import CATCH_UP
from specport.runtime.speculative.metrics import AdaptiveDraftLength
from specport.runtime.speculative.prompt_profile import OPEN_DRAFT, PromptProfile, profile_prompt
from specport.runtime.speculative.suffix import SuffixProposer

logger = logging.getLogger(__name__)

MAX_DRAFT = 16
SUFFIX_KINDS = ("own-long", "own-short", "corpus-long", "corpus-short")  # suffix.match kinds
SUFFIX_PRIORS = {"own-long": 0.5, "own-short": 0.2, "corpus-long": 0.4, "corpus-short": 0.2}
MODEL_PRIOR = 0.4  # a drafter without a measured acceptance
# a draft that is the target itself, quantized (same source and layers): SmolLM2-135M fp32
# drafted by its own 4-bit file accepted 0.75-0.8 per position (HQQ, integer zero points) and
# 0.93-0.97 (float zero points on the source's Q4_1 grid) on chat prompts
QUANTIZED_SELF_PRIOR = 0.75
DECAY = 0.9  # the estimates' memory: about ten tests
# a draft model's reading (a prefill) per token, as a share of one draft run: 4-bit SmolLM2
# reads 769 tokens at 3.4 ms each and drafts in 10-11 ms (2 AVX2 cores)
READ_PRIOR = 0.35
ANSWER_PRIOR = 128  # a request's new tokens when its budget is unknown (`generate`'s default)
ANSWER_CAP = 512  # a budget past this (a server's context-long default) says little of the answer
MODEL_DRIFT = 0.03  # untested model positions drift back to the prior (a probe now and then)
SUFFIX_DRIFT = 0.01  # suffix estimates are tested whenever a match exists: they barely drift


class HybridState:
    """The calibrated estimates: one ``AdaptiveDraftLength`` per source, their verify costs
    measured, and the drafter's own cost per draft (relative to a plain step)."""

    def __init__(
        self,
        max_draft: int,
        verify_costs: list[float],
        model_prior: Sequence[float] | None,
        model_cost: float,
    ) -> None:
        self.sources: dict[str, AdaptiveDraftLength] = {}
        for kind in SUFFIX_KINDS:
            self.sources[kind] = AdaptiveDraftLength(
                max_draft, decay=DECAY, prior=SUFFIX_PRIORS[kind], drift=SUFFIX_DRIFT
            )
        if model_prior is not None:
            rates = list(model_prior) or [MODEL_PRIOR]
            # one prior for every position (a draft model) says nothing of the later ones:
            # they follow the deepest measured one; a head's held-out rates per position stay
            ctl = AdaptiveDraftLength(
                max_draft,
                decay=DECAY,
                prior=float(rates[0]),
                drift=MODEL_DRIFT,
                extend=len(rates) == 1,
            )
            ctl.rate = [float(rates[min(i, len(rates) - 1)]) for i in range(max_draft)]
            self.sources["model"] = ctl
        for ctl in self.sources.values():
            ctl.set_verify_costs(verify_costs)
        self.model_cost = float(model_cost)  # per draft, relative to a plain step
        self.plain_s: float | None = None  # a plain step's seconds (timed, greedy only)
        self.model_s: float | None = None  # the drafter's seconds per draft (timed)
        self.read_s: float | None = None  # a draft model's seconds per token it reads (timed)
        self.costs = list(verify_costs)  # verifying k = 0..max_draft drafts, a plain step = 1
        self.live: LiveVerifyCosts | None = None  # corrects ``costs`` from timed steps
        self.last: int | None = None  # id() of the proposer that proposed last

    def clock(self) -> float:
        """Now, by the clock the verify-cost tracker times steps with (process CPU time on the
        CPU provider: ``engine.step_cost.step_clock``); wall time without a tracker."""
        return self.live.clock() if self.live is not None else time.perf_counter()

    def time_step(self, drafts: int, seconds: float, context: int = 0) -> None:
        """A timed step's verify run and host work over ``context`` tokens: corrects the verify
        costs (if tracked)."""
        if self.live is not None and self.live.observe(drafts, seconds, context):
            self.costs = self.live.costs[: len(self.costs)]
            for ctl in self.sources.values():
                ctl.set_verify_costs(self.costs)

    def read_cost(self) -> float:
        """A draft model's reading of one token, relative to a plain step: timed, else
        ``READ_PRIOR`` of a draft run."""
        if self.read_s is not None and self.plain_s:
            return self.read_s / self.plain_s
        return READ_PRIOR * self.model_cost

    def model_ctl(self) -> AdaptiveDraftLength:
        ctl = self.sources["model"]
        ctl.cost_per_draft = ctl.verify_cost + self.model_cost
        return ctl


class HybridProposer(ProposerBase):
    """Suffix matching and a model drafter, the better draft each step (module docstring)."""

    name = "auto"
    adaptive_default = False  # it sizes its own drafts from measured costs

    def __init__(
        self,
        suffix: SuffixProposer,
        model: Proposer | None,
        verify_costs: list[float],
        model_prior: Sequence[float] | None = None,
        model_max: int = MAX_DRAFT,
        shared: HybridState | None = None,
    ) -> None:
        self.suffix = suffix
        self.model = model
        self.model_max = int(model_max)  # e.g. an MTP artifact's heads
        self.needs_outputs = bool(model is not None and model.needs_outputs)
        self.max_draft = len(verify_costs) - 1
        self._costs = list(verify_costs)
        self._prior = None if model is None else (model_prior or [MODEL_PRIOR])
        self._model_cost = 0.0
        self._shared = shared
        self.state = self._fresh()
        self.timed = False
        self.choices: dict[str, int] = {}  # this request's steps per choice (plain, suffix,
        # model, model+suffix; probe: a one-draft verify timed for the costs)
        # drafts waiting for the tokens that score them: (estimate, draft, context position,
        # leading tokens that must come true before the rest is scored: an extension's)
        self._tests: list[tuple[AdaptiveDraftLength, list[int], int, int]] = []
        self._tested: set[int] = set()  # estimates scored since the last step
        self._fed = 0  # drafts the last propose made
        self._at = 0  # the context they followed
        self._end: float | None = None  # when the last propose returned
        self.profile: PromptProfile | None = None  # this request's prompt (its first propose)
        self.cap = self.max_draft  # this request's most drafts per step (from its profile)
        self.budget = ANSWER_PRIOR  # this request's new tokens, as far as they say anything
        self.prompt_len = 0

    def _fresh(self) -> HybridState:
        return HybridState(self.max_draft, self._costs, self._prior, self._model_cost)

    def set_model_cost(self, cost: float) -> None:
        """The drafter's prior cost per draft (its ``draft_cost``), relative to a plain step."""
        self._model_cost = float(cost)
        self.state.model_cost = self._model_cost
        if self._shared is not None and self._shared.plain_s is None:
            self._shared.model_cost = self._model_cost

    # ---- protocol -------------------------------------------------------------------
    def start(
        self, sampling: Any = None, stream: int | None = None, budget: int | None = None
    ) -> None:
        greedy = sampling is None or bool(getattr(sampling, "greedy", True))
        self.timed = greedy
        self.state = self._shared if greedy and self._shared is not None else self._fresh()
        self._tests, self._tested, self._fed, self._end = [], set(), 0, None
        self.choices = {}
        self.profile, self.cap = None, self.max_draft
        self.budget = min(ANSWER_PRIOR if budget is None else int(budget), ANSWER_CAP)
        self.prompt_len = 0
        self.suffix.start(sampling, stream)
        if self.model is not None:
            self.model.start(sampling, stream, budget)

    def draft_cost(self, target: Any) -> float:
        return 0.0  # priced per step by the hybrid itself

    def share_target_kv(self, cache: Any, row: int) -> bool:
        return self.model is not None and self.model.share_target_kv(cache, row)

    def finish(self, answer: Sequence[int]) -> None:
        self.suffix.finish(answer)
        if self.model is not None:
            self.model.finish(answer)

    def propose(self, context: list[list[int]], num_draft: int) -> Drafts:
        if len(context) != 1:
            raise ValueError(f"the hybrid proposer drafts one row, got {len(context)}")
        self._time_rest(self.state.clock())
        if self.profile is None:
            self._profile(context[0])
        self._score(context[0])
        drafts = self._choose(context[0], min(int(num_draft), self.cap))
        self._fed, self._at = len(drafts), len(context[0])
        self._end = self.state.clock()
        return Drafts.one(drafts)

    def _profile(self, prompt: list[int]) -> None:
        """The request's prompt, before its first step: the own-text replay joins the
        own-text estimates, and the draft cap follows from whether it copies well."""
        profile = self.profile = profile_prompt(prompt)
        self.prompt_len = len(prompt)
        for kind in ("own-long", "own-short"):
            ctl = self.state.sources[kind]
            ctl.rate = profile.rates(kind, ctl.rate)
        self.cap = self.max_draft if profile.copy_heavy else min(self.max_draft, OPEN_DRAFT)

    def observe(self, outputs: dict[str, np.ndarray], result: Any) -> None:
        if self.model is not None:
            self.model.observe(outputs, result)

    def _score(self, ctx: list[int]) -> None:
        """Score the waiting drafts whose end or first miss the context now shows; estimates
        not tested since the last step drift back toward their priors."""
        waiting = []
        for ctl, draft, at, skip in self._tests:
            if skip:  # an extension: scored only where the model's drafts came true
                before = ctx[at : at + skip]
                if before != draft[:skip][: len(before)]:
                    continue
                if len(before) < skip:
                    waiting.append((ctl, draft, at, skip))
                    continue
                draft, at, skip = draft[skip:], at + skip, 0
            known = ctx[at : at + len(draft)]
            m = 0
            while m < len(known) and draft[m] == known[m]:
                m += 1
            if m < len(known):  # a miss at m: positions before it accepted
                ctl.observe(m + 1, m)
            elif len(known) == len(draft):  # every draft matched
                ctl.observe(len(draft), len(draft))
            else:
                waiting.append((ctl, draft, at, 0))
                continue
            self._tested.add(id(ctl))
        self._tests = waiting
        for ctl in self.state.sources.values():
            if id(ctl) not in self._tested:
                ctl.observe(0, 0)
        self._tested = set()

    # ---- the choice -----------------------------------------------------------------
    def _choose(self, ctx: list[int], cap: int) -> list[int]:
        if cap <= 0:
            return self._chose("plain", [])
        state = self.state
        best_value, best = 1.0, "plain"
        sdraft, kind = self.suffix.match(ctx, cap)
        s_k = 0
        if sdraft:
            sctl = state.sources[kind]
            self._tests.append((sctl, sdraft, len(ctx), 0))  # scored, used or not (it is free)
            s_k, value = sctl.best(sctl.expected_tokens(len(sdraft)))
            if s_k and value > best_value:
                best_value, best = value, "suffix"
        if self.model is not None:
            mctl = state.model_ctl()
            m_k, value = mctl.best(mctl.expected_tokens(min(cap, self.model_max)))
            if m_k and value > best_value and self._reading_pays(ctx, value):
                return self._model(ctx, cap, m_k, mctl)
        if best == "suffix":
            return self._chose("suffix", sdraft[:s_k])
        if sdraft and self.timed and state.live is not None and state.live.probe():
            return self._chose("probe", sdraft[:1])  # times a one-draft verify (LiveVerifyCosts)
        return self._chose("plain", [])

    def _reading_pays(self, ctx: list[int], value: float) -> bool:
        """Whether the text a draft model must read before drafting (module docstring) costs
        less than its drafts are expected to save on the rest of the answer: each token then
        costs ``1 / value`` plain steps instead of one."""
        behind = getattr(self.model, "behind", None)
        unread = behind(ctx) if behind is not None else 0
        if unread <= CATCH_UP:
            return True
        left = max(self.budget - (len(ctx) - self.prompt_len), 1)
        return left * (1.0 - 1.0 / value) > unread * self.state.read_cost()

    def _model(self, ctx: list[int], cap: int, k: int, mctl: AdaptiveDraftLength) -> list[int]:
        """Run the drafter for ``k`` drafts; extend them by a suffix match when that pays."""
        t0 = self.state.clock()
        mdraft = self.model.propose([ctx], k).row(0)[:k]  # type: ignore[union-attr]
        read = getattr(self.model, "caught_up", 0)
        if read <= CATCH_UP:
            self._time_model(self.state.clock() - t0, len(mdraft))
        else:  # a draft model read a prompt (or text it skipped) first: a prefill, timed apart
            self._time_read(self.state.clock() - t0, read, len(mdraft))
        if not mdraft:
            return self._chose("plain", [])
        self._tests.append((mctl, mdraft, len(ctx), 0))
        expected = mctl.expected_tokens(len(mdraft))
        # all of the model's drafts accepted
        reach = float(np.prod(mctl.estimates()[: len(mdraft)]))
        room = cap - len(mdraft)
        if room > 0 and reach > 0.05:
            ext, kind = self.suffix.match(ctx + mdraft, room)
            if ext:
                sctl = self.state.sources[kind]
                gain = sctl.expected_tokens(len(ext))
                base = expected[-1] / mctl.step_cost(len(mdraft))
                best_j, best = 0, base
                for j in range(1, len(ext) + 1):
                    value = (expected[-1] + reach * (gain[j] - 1.0)) / mctl.step_cost(
                        len(mdraft) + j
                    )
                    if value > best:
                        best_j, best = j, value
                if best_j:
                    fed = mdraft + ext[:best_j]
                    self._tests.append((sctl, fed, len(ctx), len(mdraft)))
                    return self._chose("model+suffix", mdraft + ext[:best_j])
        return self._chose("model", mdraft)

    def _chose(self, what: str, drafts: list[int]) -> list[int]:
        self.choices[what] = self.choices.get(what, 0) + 1
        return drafts

    # ---- timing (greedy only: under sampling the choice must not depend on the clock) ----
    def _time_rest(self, now: float) -> None:
        """The time since the last propose returned: the rest of that step (its verify run
        and host work), which costs ``verify_costs[fed]`` plain steps. Timed only where the
        step was this row's alone: rows decoding together (a batch, several completions)
        share the estimates, and one row's time would then hold the others' work."""
        state = self.state
        alone = state.last == id(self)  # no other row's work since this row's last step
        state.last = id(self)
        if not self.timed or self._end is None or not alone:
            return
        rest = now - self._end
        state.time_step(self._fed, rest, self._at)
        if state.sources.get("model") is None:
            return
        plain = rest / state.costs[min(self._fed, len(state.costs) - 1)]
        if state.plain_s is None:
            state.plain_s = plain
        elif plain < 4.0 * state.plain_s:  # a stall (or a new request's prefill) is no trend
            state.plain_s = DECAY * state.plain_s + (1.0 - DECAY) * plain
        self._update_model_cost()

    def _time_model(self, seconds: float, drafts: int) -> None:
        if not self.timed or drafts <= 0:
            return
        per = seconds / drafts
        state = self.state
        state.model_s = per if state.model_s is None else DECAY * state.model_s + (1 - DECAY) * per
        self._update_model_cost()

    def _time_read(self, seconds: float, tokens: int, drafts: int) -> None:
        """A propose that read ``tokens`` and then made ``drafts``: the reading's share (the
        drafts at their timed price) per token read."""
        state = self.state
        if not self.timed or state.model_s is None:
            return
        per = max(seconds - drafts * state.model_s, 0.0) / tokens
        state.read_s = per if state.read_s is None else DECAY * state.read_s + (1 - DECAY) * per

    def _update_model_cost(self) -> None:
        state = self.state
        if state.plain_s and state.model_s is not None:
            state.model_cost = min(state.model_s / state.plain_s, 4.0)


_STATES: weakref.WeakKeyDictionary[Any, HybridState] = weakref.WeakKeyDictionary()


def make_hybrid_proposer(
    model: Any, num_draft: int, draft_model: Any | None = None
) -> HybridProposer:
    """``--speculative auto`` for a loaded model: suffix matching plus the model drafter the
    artifact has (``draft_model`` when given, else its EAGLE head, else its MTP heads; none:
    suffix matching alone), sized from this machine's measured verify costs."""
    from specport.runtime.engine.step_cost import verify_costs

    drafter, prior, model_max = _drafter(model, draft_model)
    table = verify_costs(model, MAX_DRAFT)
    costs = table[: max(int(num_draft), 1) + 1]
    suffix = SuffixProposer(model.suffix_index, max_draft=max(int(num_draft), 1))
    shared = None
    try:
        shared = _STATES.get(model)
        if (
            shared is None
            or shared.sources.keys() != _sources(drafter)
            or len(next(iter(shared.sources.values())).rate) != len(costs) - 1
        ):
            shared = HybridState(len(costs) - 1, costs, prior, 0.0)
            shared.live = live_verify_costs(model)  # the one the adaptive draft length uses
            _STATES[model] = shared
    except TypeError:  # not weakly referenceable: estimates per request
        shared = None
    proposer = HybridProposer(suffix, drafter, costs, prior, model_max, shared)
    if drafter is not None:
        proposer.set_model_cost(drafter.draft_cost(model.manifest))
    return proposer


def _sources(drafter: Proposer | None) -> set[str]:
    return set(SUFFIX_KINDS) | ({"model"} if drafter is not None else set())


def _drafter(model: Any, draft_model: Any | None) -> tuple[Proposer | None, Any, int]:
    """(the model drafter, its acceptance prior per position or None, most drafts it makes)."""
    manifest = model.manifest
    if draft_model is not None:
        from specport.runtime.speculative.draft import DraftModelProposer

        proposer = DraftModelProposer(
            draft_model.session, draft_model.manifest, manifest.vocab_size
        )
        prior = (
            QUANTIZED_SELF_PRIOR if quantized_self(manifest, draft_model.manifest) else MODEL_PRIOR
        )
        return proposer, [prior], MAX_DRAFT
    eagle = manifest.extra.get("eagle") or {}
    if eagle.get("graph"):
        from specport.runtime.speculative.eagle import make_eagle_proposer

        heldout = ((eagle.get("training") or {}).get("heldout") or {}).get(
            "acceptance_per_position"
        )
        return make_eagle_proposer(model), list(heldout or [MODEL_PRIOR]), MAX_DRAFT
    mtp = manifest.mtp or {}
    if mtp.get("heads"):
        from specport.runtime.speculative.mtp import MTPProposer

        mtp_proposer = MTPProposer(manifest)
        model.ensure_mtp_branch()
        return mtp_proposer, [MODEL_PRIOR], mtp_proposer.heads
    return None, None, 0


def quantized_self(target: Any, draft: Any) -> bool:
    """Whether `draft` is the target's own model quantized: the same source (`source_of`) and
    as many layers, with a `quant` record."""
    from specport.runtime.speculative.draft import num_layers, source_of

    return (
        bool(getattr(draft, "quant", None))
        and source_of(draft) == source_of(target)
        and num_layers(draft) == num_layers(target)
        and bool(source_of(target)[0])
    )
