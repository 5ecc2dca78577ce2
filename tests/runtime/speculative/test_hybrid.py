"""The hybrid proposer (`--speculative auto`): each step the draft with the most expected tokens
per unit of measured cost, plain decoding when none pays; suffix drafts scored against what the
target emitted whether used or not; verify costs measured once per machine and artifact."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from specport.runtime.engine import step_cost
from specport.runtime.speculative.base import Drafts, ProposerBase
from specport.runtime.speculative.hybrid import HybridProposer
from specport.runtime.speculative.metrics import AdaptiveDraftLength
from specport.runtime.speculative.prompt_profile import profile_prompt
from specport.runtime.speculative.suffix import SuffixIndex, SuffixProposer
from specport.runtime.speculative.verify import VerifyResult

CHEAP = [1.0, 1.05, 1.1, 1.15, 1.2, 1.25, 1.3, 1.35, 1.4]  # verify cost of k = 0..8 drafts


class FakeDrafter(ProposerBase):
    """A model drafter that always guesses ``tokens`` and counts its runs."""

    name = "fake"
    needs_outputs = True

    def __init__(self, tokens: list[int], cost: float = 0.05) -> None:
        self.tokens, self.cost, self.runs, self.seen = tokens, cost, 0, 0

    def propose(self, context: list[list[int]], num_draft: int) -> Drafts:
        self.runs += 1
        return Drafts.one(self.tokens[:num_draft])

    def observe(self, outputs: dict[str, np.ndarray], result: Any) -> None:
        self.seen += 1

    def draft_cost(self, target: Any) -> float:
        return self.cost


def _hybrid(
    drafter: FakeDrafter | None,
    corpus: list[list[int]] = (),
    budget: int | None = None,
    **rates: float,
):
    index = SuffixIndex()
    index.extend(corpus)
    hybrid = HybridProposer(
        SuffixProposer(index, max_draft=8), drafter, CHEAP, None if drafter is None else [0.5]
    )
    if drafter is not None:
        hybrid.set_model_cost(drafter.cost)
    hybrid.start(None, budget=budget)
    hybrid.profile = profile_prompt([])  # these requests' prompts measure nothing: rates as set
    for name, rate in rates.items():  # own=: both own-text kinds
        for kind in ("own-long", "own-short") if name == "own" else (name.replace("_", "-"),):
            hybrid.state.sources[kind].rate = [rate] * 8
    return hybrid


def _verdict(emitted: list[int]) -> VerifyResult:
    return VerifyResult(np.array([len(emitted) - 1]), [emitted], np.array([False]))


def test_a_suffix_match_expected_to_yield_more_replaces_the_model_draft():
    model = FakeDrafter([9, 9, 9])
    hybrid = _hybrid(model, own=0.9, model=0.3)
    drafts = hybrid.propose([[1, 2, 3, 4, 5, 1, 2, 3]], 8)
    assert drafts.row(0)[:2] == [4, 5] and model.runs == 0  # the model is not even run
    assert hybrid.choices == {"suffix": 1}
    hybrid.start(None)
    assert hybrid.choices == {}  # counted per request


def test_the_model_drafts_when_its_acceptance_pays_and_a_match_extends_it():
    model = FakeDrafter([7, 8])
    hybrid = _hybrid(model, [[7, 8, 20, 21, 22]], model=0.9, corpus_short=0.9, corpus_long=0.9)
    hybrid.state.sources["model"].rate = [0.9, 0.9] + [0.0] * 6  # two good drafts, no more
    drafts = hybrid.propose([[1, 2, 3]], 6)
    assert drafts.row(0)[:2] == [7, 8] and model.runs == 1
    assert drafts.row(0)[2:] == [20, 21, 22]  # what followed 7, 8 in an earlier answer
    assert hybrid.choices == {"model+suffix": 1}


def test_plain_decoding_when_no_draft_is_expected_to_pay():
    model = FakeDrafter([9, 9], cost=0.3)
    hybrid = _hybrid(model, own=0.02, model=0.1)
    assert hybrid.propose([[1, 2, 3, 1, 2]], 8).row(0) == []
    assert model.runs == 0 and hybrid.choices == {"plain": 1}
    hybrid.observe({}, _verdict([3]))
    assert model.seen == 1  # the model still sees every run's outputs (its features)


def test_every_draft_is_scored_against_the_tokens_that_follow_used_or_not():
    model = FakeDrafter([4, 9])
    hybrid = _hybrid(model, own=0.05, model=0.95)
    ctx = [1, 2, 3, 4, 5, 1, 2, 3]
    drafts = hybrid.propose([ctx], 4)
    assert drafts.row(0) == [4, 9]  # the model's (the suffix match would draft 4, 5, 1, 2)
    own, mctl = hybrid.state.sources["own-long"], hybrid.state.sources["model"]
    before = list(mctl.rate)
    hybrid.observe({}, _verdict([4, 5]))  # model: 1 of 2 accepted, then the target's 5
    hybrid.propose([[*ctx, 4, 5]], 4)
    assert mctl.rate[0] > before[0] and mctl.rate[1] < before[1]  # 4 came true, 9 did not
    assert own.rate[:2] > [0.05, 0.05] and own.rate[2] == pytest.approx(0.05, abs=0.01)
    hybrid.observe({}, _verdict([1, 2]))
    hybrid.propose([[*ctx, 4, 5, 1, 2]], 4)  # later tokens score the rest of the match
    assert own.rate[2] > 0.1 and own.rate[3] > 0.1


def test_without_a_drafter_it_is_suffix_matching_alone():
    hybrid = _hybrid(None, own=0.9)
    assert "model" not in hybrid.state.sources
    assert hybrid.propose([[1, 2, 3, 1, 2]], 8).row(0)[:1] == [3]
    assert hybrid.propose([[5, 6, 7]], 8).row(0) == []


def test_greedy_requests_share_the_estimates_and_sampled_ones_start_from_priors():
    from specport.runtime.sampler import SamplingConfig
    from specport.runtime.speculative.hybrid import HybridState

    shared = HybridState(8, CHEAP, [0.5], 0.05)
    index = SuffixIndex()
    hybrid = HybridProposer(SuffixProposer(index), FakeDrafter([1]), CHEAP, [0.5], shared=shared)
    hybrid.start(SamplingConfig())
    assert hybrid.state is shared and hybrid.timed
    hybrid.start(SamplingConfig(greedy=False, seed=1))
    assert hybrid.state is not shared and not hybrid.timed  # the clock never steers a seed


def test_measured_verify_costs_set_the_draft_length():
    ctl = AdaptiveDraftLength(8, prior=0.7)
    flat_then_steep = [1.0, 1.02, 1.04, 1.06, 2.5, 2.6, 2.7, 2.8, 2.9]
    ctl.set_verify_costs(flat_then_steep)
    assert ctl.choose() == 3  # drafts are nearly free up to 3, then the run turns costly
    assert ctl.best([1.0, 1.01])[0] == 0  # a draft that adds almost nothing does not pay


def test_relative_costs_interpolate_and_never_fall():
    costs = step_cost.relative_costs([0.010, 0.013, 0.012, 0.020], [1, 2, 3, 5], 6)
    assert costs[0] == pytest.approx(1.0) and costs[1] == pytest.approx(1.3)
    assert costs[2] == pytest.approx(1.3)  # a noisy dip does not make more tokens cheaper
    assert costs[3] == pytest.approx(1.65) and costs[4] == pytest.approx(2.0)
    assert costs[6] == pytest.approx(2.7)  # past the widest width: its last slope


IDLE = (0.5, 2)  # (1-minute load average, cores): a machine where timings may be kept
BUSY = (13.7, 2)  # an oversubscribed one


def test_verify_costs_are_measured_once_per_machine_and_artifact(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPORT_CACHE", str(tmp_path))
    runs: list[int] = []

    def fake_measure(session: Any, manifest: Any, widths=step_cost.WIDTHS, clock=None):
        runs.append(1)
        return [0.01 * (1 + 0.1 * (w - 1)) for w in widths]

    monkeypatch.setattr(step_cost, "measure_widths", fake_measure)

    def model(digest: str) -> Any:
        manifest = SimpleNamespace(files={"model.onnx": digest})
        return SimpleNamespace(manifest=manifest, path=tmp_path, session=None, provider="cpu")

    first = step_cost.verify_costs(model("a"), 4, lambda: IDLE)
    assert first == pytest.approx([1.0, 1.1, 1.2, 1.3, 1.4]) and len(runs) == 1
    step_cost._MEMO.clear()  # a new process
    assert step_cost.verify_costs(model("a"), 4) == first and len(runs) == 1  # from disk
    step_cost.verify_costs(model("b"), 4, lambda: IDLE)  # another artifact: measured
    assert len(runs) == 2
    assert len(json.loads((tmp_path / "step_costs.json").read_text())) == 2


def test_verify_costs_measured_on_an_oversubscribed_machine_are_not_kept(
    tmp_path, monkeypatch, caplog
):
    monkeypatch.setenv("SPECPORT_CACHE", str(tmp_path))
    runs: list[int] = []

    def fake_measure(session: Any, manifest: Any, widths=step_cost.WIDTHS, clock=None):
        runs.append(1)
        return [0.01 * w for w in widths]

    monkeypatch.setattr(step_cost, "measure_widths", fake_measure)
    manifest = SimpleNamespace(files={"model.onnx": "busy"})
    model = SimpleNamespace(manifest=manifest, path=tmp_path, session=None, provider="cpu")
    with caplog.at_level("INFO", logger=step_cost.__name__):
        step_cost.verify_costs(model, 4, lambda: BUSY)
    assert not (tmp_path / "step_costs.json").exists()
    assert "load average 13.7 exceeds the 2 cores" in caplog.text
    step_cost._MEMO.clear()  # a new process on a quieter machine measures again, and keeps it
    step_cost.verify_costs(model, 4, lambda: IDLE)
    assert len(runs) == 2 and (tmp_path / "step_costs.json").exists()


def test_timed_steps_correct_verify_costs_measured_under_load():
    kept: list[list[float]] = []
    live = step_cost.LiveVerifyCosts([1.0, 1.3, 1.5, 1.7, 1.9], kept.append, load=lambda: IDLE)
    for i in range(2 * step_cost.LIVE_MIN):  # plain 10 ms, one draft 10.5 ms, some stalls
        stall = 5.0 if i % 7 == 0 else 1.0
        live.observe(i % 2, stall * (0.010 if i % 2 == 0 else 0.0105))
    assert live.costs[1] == pytest.approx(1.05, rel=0.01)
    assert live.costs[2] == pytest.approx(1.5 * 1.05 / 1.3, rel=0.01)  # the nearest's factor
    assert kept == [live.costs]  # off by more than LIVE_KEEP: the next run starts from it


def test_verify_steps_are_priced_against_plain_steps_at_their_own_context():
    """Drafts come where text repeats, in long prompts more than short ones, and a step over
    800 tokens of context costs more than one over 100 whatever it verifies. Against every
    plain step, the 2-draft steps of long requests (here all of them) would read 1.6 plain
    steps; against the plain steps nearest in context they cost what they cost: 1.2."""
    live = step_cost.LiveVerifyCosts([1.0, 1.1, 1.2, 1.3], load=lambda: IDLE)

    def plain_s(context: int) -> float:
        return 0.010 + 0.010 * context / 800  # 10 ms + attention over the context

    for i in range(4 * step_cost.LIVE_MIN):
        short, long = 40 + i, 800 + i  # a short request's plain steps, a long one's
        live.observe(0, plain_s(short), short)
        live.observe(0, plain_s(long), long)
        live.observe(2, 1.2 * plain_s(long), long)
    assert live.costs[2] == pytest.approx(1.2, rel=0.02)


def test_a_table_that_holds_is_kept_and_probes_stop_once_one_draft_is_timed():
    kept: list[list[float]] = []
    live = step_cost.LiveVerifyCosts([1.0, 1.05, 1.1], kept.append, load=lambda: IDLE)
    probes = 0
    for _ in range(20 * step_cost.PROBE_EVERY):
        if live.probe():
            probes += 1
            live.observe(1, 0.0106)
        else:
            live.observe(0, 0.010)
    assert probes == step_cost.LIVE_MIN
    assert live.costs[1] == pytest.approx(1.06, rel=0.01) and kept == []


def test_the_hybrid_probes_a_table_that_prices_drafts_out_and_drafts_once_corrected():
    from specport.runtime.speculative.hybrid import HybridState

    clock = [0.0]
    pessimistic = [1.0, 1.6, 1.7, 1.8, 1.9, 2.0, 2.1, 2.2, 2.3]  # measured under load
    shared = HybridState(8, pessimistic, None, 0.0)
    shared.live = step_cost.LiveVerifyCosts(pessimistic, clock=lambda: clock[0])
    hybrid = HybridProposer(
        SuffixProposer(SuffixIndex(), max_draft=8), None, pessimistic, None, shared=shared
    )
    hybrid.start(None)
    ctx = [1, 2, 3, 4, 1, 2, 3]
    for _ in range(40 * step_cost.PROBE_EVERY):
        for ctl in shared.sources.values():
            ctl.rate = [0.3] * 8  # 1.3 tokens for a 1.6 verify: the table says never draft
        drafts = hybrid.propose([ctx], 8).row(0)
        clock[0] += 0.0105 if drafts else 0.010  # what this machine really takes
        ctx.append(ctx[-4])
    assert hybrid.choices["probe"] == step_cost.LIVE_MIN
    assert shared.costs[1] == pytest.approx(1.05, rel=0.01)
    assert shared.sources["own-long"].verify_costs == shared.costs
    assert len(hybrid.propose([ctx], 8).row(0)) >= 1 and hybrid.choices["suffix"] >= 1


def test_corrected_costs_are_kept_for_the_next_run(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPORT_CACHE", str(tmp_path))
    loaded = [0.010] + [0.016 + 0.001 * (w - 2) for w in step_cost.WIDTHS[1:]]
    monkeypatch.setattr(step_cost, "measure_widths", lambda *args: loaded)
    model = SimpleNamespace(
        manifest=SimpleNamespace(files={"model.onnx": "c"}), path=tmp_path, session=None
    )
    assert step_cost.verify_costs(model, 2) == pytest.approx([1.0, 1.6, 1.7])
    step_cost.keep_verify_costs(model, [1.0, 1.05, 1.1, 1.2])
    step_cost._MEMO.clear()  # a new process: read from disk
    assert step_cost.verify_costs(model, 3) == pytest.approx([1.0, 1.05, 1.1, 1.2])


def test_rows_decoding_together_do_not_time_each_others_steps():
    from specport.runtime.speculative.hybrid import HybridState

    shared = HybridState(8, CHEAP, None, 0.0)
    shared.live = step_cost.LiveVerifyCosts(CHEAP)
    rows = [
        HybridProposer(SuffixProposer(SuffixIndex()), None, CHEAP, None, shared=shared)
        for _ in range(2)
    ]
    for row in rows:
        row.start(None)
    for _ in range(4):  # a batched run: both rows propose every step
        for row in rows:
            row.propose([[1, 2, 3]], 4)
    assert shared.live.steps == 0
    for _ in range(4):  # one row alone
        rows[0].propose([[1, 2, 3]], 4)
    assert shared.live.steps == 3  # its first step still followed the other row's


ALONE = [1.0, 1.08, 1.1, 1.12, 1.14, 1.16, 1.18, 1.2, 1.22]  # verify costs timed alone
LOADED = [1.0, 1.6, 1.7, 1.8, 1.9, 2.0, 2.1, 2.2, 2.3]  # a table measured under load


def _busy_machine_run(table: list[float], clock: str, load: tuple[float, int], steps: int):
    """A hybrid decoding text it drafts well on a machine with more runnable threads than
    cores: a step's work is 10 ms (plain) or ``ALONE[k]`` times that (one draft: 1.08 plain
    steps, what a verify costs timed alone), but while it waits for a core the wall clock runs on, and a longer
    (verify) run waits more: its wall time reads 4x a plain step's. The tracker times the
    steps by ``clock``."""
    from specport.runtime.speculative.hybrid import HybridState

    cpu, wall, kept = [0.0], [0.0], []
    read = (lambda: cpu[0]) if clock == "cpu" else (lambda: wall[0])
    shared = HybridState(8, table, None, 0.0)
    shared.live = step_cost.LiveVerifyCosts(table, kept.append, read, lambda: load)
    hybrid = HybridProposer(
        SuffixProposer(SuffixIndex(), max_draft=8), None, table, None, shared=shared
    )
    hybrid.start(None)
    ctx = [1, 2, 3, 4, 1, 2, 3]
    for i in range(steps):
        for ctl in shared.sources.values():
            ctl.rate = [0.5] * 8  # 1.5 tokens for one draft, 1.94 for four
        drafts = hybrid.propose([ctx], 8).row(0)
        work = 0.010 * ALONE[len(drafts)]  # what the runs cost, whatever the table says
        cpu[0] += work
        wall[0] += work * (4.0 if drafts else 1.0)
        ctx.append(ctx[-4] if i % 3 else 1000 + i)  # every third token new: nothing to match
    return hybrid, shared.live, kept


@pytest.mark.parametrize("clock", ["cpu", "wall"])
def test_steps_timed_in_cpu_time_keep_drafts_paying_on_a_busy_machine(clock):
    """In CPU time the waits for a core do not count and one draft stays at 1.08 plain steps;
    by the wall clock (how steps were timed before) it reads 4, and auto stops drafting."""
    steps = 40 * step_cost.PROBE_EVERY
    hybrid, live, kept = _busy_machine_run(ALONE, clock, BUSY, steps)
    if clock == "cpu":
        assert live.costs[1] == pytest.approx(1.08, rel=0.02)
        assert hybrid.choices["suffix"] > 0.6 * steps  # every step with a match drafts
    else:
        assert live.costs[1] > 3.5 and hybrid.choices["plain"] > 0.8 * steps
        assert "load average 13.7 exceeds the 2 cores" in (live.unkept or "")
    assert kept == []  # measured at a load above the core count: never written for later runs


def test_a_correction_measured_on_a_quiet_machine_is_kept():
    hybrid, live, kept = _busy_machine_run(LOADED, "cpu", IDLE, 40 * step_cost.PROBE_EVERY)
    assert kept and kept[-1][1] < 1.1 and live.unkept is None  # no longer LOADED's 1.6
    assert hybrid.choices["suffix"] > hybrid.choices["plain"]


def test_a_correction_measured_on_a_busy_machine_serves_this_process_only(caplog):
    with caplog.at_level("INFO", logger=step_cost.__name__):
        hybrid, live, kept = _busy_machine_run(LOADED, "cpu", BUSY, 40 * step_cost.PROBE_EVERY)
    assert live.costs[1] < 1.1 and kept == []
    assert caplog.text.count("corrected verify costs not kept for later runs") == 1


@pytest.mark.parametrize(
    ("provider", "clock"),
    [("cpu", "process_time"), ("openvino", "process_time"), ("cuda", "perf_counter")],
)
def test_steps_are_timed_in_cpu_time_where_the_graph_runs_on_this_process(provider, clock):
    import time

    assert step_cost.step_clock(provider) is getattr(time, clock)


@pytest.mark.parametrize(("load", "kept"), [(1.9, True), (2.0, True), (2.1, False), (24.6, False)])
def test_timings_are_kept_only_at_a_load_up_to_the_core_count(load, kept):
    assert (step_cost.busy(load, 2) is None) == kept


def _manifest(layers: int, bits: float | None = None, gguf: str = "g1") -> SimpleNamespace:
    quant = {"scheme": "w4a8", "size": {"bits_per_weight": bits}} if bits else None
    source = {"config_sha256": "c1", "path": "model.gguf", "gguf": {"sha256": gguf}}
    return SimpleNamespace(
        config={"num_layers": layers}, quant=quant, source=source, dtype="float32"
    )


def test_a_draft_models_prior_cost_is_its_share_of_the_weight_bytes():
    """One draft-model run reads the draft's weights once: layers times bits per weight against
    the target's. A 4-bit copy of the target itself costs about a quarter of a float step, not
    a whole one (which priced it out of `auto` before it ever ran)."""
    from specport.runtime.speculative.draft import DraftModelProposer

    draft = object.__new__(DraftModelProposer)
    draft.manifest = _manifest(30, bits=8.5)
    assert DraftModelProposer.draft_cost(draft, _manifest(30)) == pytest.approx(8.5 / 32)
    draft.manifest = _manifest(6)  # a float self-draft of the first 6 layers
    assert DraftModelProposer.draft_cost(draft, _manifest(30)) == pytest.approx(0.2)


def test_the_targets_own_quantization_starts_from_a_higher_acceptance():
    from specport.runtime.speculative.hybrid import quantized_self

    target = _manifest(30)
    assert quantized_self(target, _manifest(30, bits=5.0))
    assert not quantized_self(target, _manifest(30))  # not quantized: another float model
    assert not quantized_self(target, _manifest(6, bits=5.0))  # fewer layers
    assert not quantized_self(target, _manifest(30, bits=5.0, gguf="other"))  # other weights


def test_a_draft_models_prompt_reading_is_not_timed_as_drafts():
    """A draft model reads the prompt (or the text it skipped while others drafted) in its
    first run: a prefill. Timed as one draft it would price the model out for good."""
    model = FakeDrafter([7, 8])
    hybrid = _hybrid(model, model=0.9)
    hybrid.timed = True
    model.caught_up = 40  # the whole prompt
    hybrid.propose([[1, 2, 3]], 2)
    assert model.runs == 1 and hybrid.state.model_s is None
    model.caught_up = 2  # the bonus token and the last draft: a draft's own run
    hybrid.propose([[1, 2, 3, 7, 8]], 2)
    assert model.runs == 2 and hybrid.state.model_s is not None


def test_a_draft_models_one_prior_lets_later_positions_follow_the_measured_ones():
    """`auto` with a draft model starts every position from one prior (0.75 for the target's
    own quantized file): a first position measured right 0.97 of the time must lift the ones
    behind it, or the model drafts one token per step (SmolLM2 chat: 2.15 tokens per step and
    1.11x plain, 4.26 and 1.34x with this). A head's held-out rates per position are kept."""
    from specport.runtime.speculative.hybrid import HybridState

    costs = [1.0, 1.09, 1.22, 1.35, 1.45]
    draft = HybridState(4, costs, [0.75], 0.4).sources["model"]
    head = HybridState(4, costs, [0.5, 0.45, 0.4, 0.35], 0.1).sources["model"]
    for ctl in (draft, head):
        for _ in range(20):
            ctl.observe(1, 1)  # position 0 always right; nothing deeper tested yet
    assert draft.estimates()[1:] == [draft.rate[0]] * 3
    assert head.estimates()[1:] == head.rate[1:] != [head.rate[0]] * 3


class ReadingDrafter(FakeDrafter):
    """A draft model: before drafting it reads whatever of the context it has not read."""

    def __init__(self, tokens: list[int], cost: float = 0.4) -> None:
        super().__init__(tokens, cost)
        self.read: list[int] = []
        self.caught_up = 0

    def behind(self, row: list[int]) -> int:
        return len(row) - len(self.read)

    def propose(self, context: list[list[int]], num_draft: int) -> Drafts:
        self.caught_up = self.behind(context[0])
        self.read = list(context[0])
        return super().propose(context, num_draft)


@pytest.mark.parametrize(
    ("prompt", "budget", "drafts"),
    [(40, 128, True), (770, 128, False), (770, 512, True), (770, None, False)],
)
def test_a_draft_model_reads_a_long_prompt_only_for_an_answer_long_enough_to_repay_it(
    prompt, budget, drafts
):
    """A 4-bit SmolLM2 drafting for its fp32 self reads a 769-token article slower than the
    target does: on a 128-token answer its drafts never repay that (Spec-Bench summarisation:
    `auto` with the draft 0.85x plain, without it 1.29x). The reading is weighed against what
    the drafts save over the answer's remaining tokens (the budget; 128 when unknown)."""
    model = ReadingDrafter([7, 8, 9, 10], cost=0.4)
    hybrid = _hybrid(model, budget=budget, model=0.95)
    ctx = list(range(11, 11 + prompt))
    hybrid.prompt_len = prompt
    hybrid.propose([ctx], 4)
    assert (model.runs == 1) is drafts
    assert hybrid.choices.get("model", 0) == int(drafts)


def test_a_draft_model_that_has_read_the_prompt_keeps_drafting_to_the_end():
    """Once read, only the tokens since its last draft are unread: the model drafts on."""
    model = ReadingDrafter([7, 8, 9, 10], cost=0.4)
    hybrid = _hybrid(model, budget=512, model=0.95)
    ctx = list(range(11, 11 + 770))
    hybrid.prompt_len = len(ctx)
    hybrid.propose([ctx], 4)
    hybrid.budget = 8  # near its end, the answer has few tokens left ...
    hybrid.propose([[*ctx, 7, 8, 9, 10, 3]], 4)  # ... and the draft missed one step's tokens
    assert model.runs == 2


def test_a_draft_models_reading_is_timed_per_token_apart_from_its_drafts():
    """The reading's share of a propose that read and then drafted, per token read."""
    model = ReadingDrafter([7, 8])
    hybrid = _hybrid(model, model=0.9)
    hybrid.timed = True
    hybrid.state.model_s = 0.01  # its drafts' measured price
    hybrid._time_read(0.5, 98, 2)  # a propose: 0.5 s for 98 tokens read and 2 drafts
    assert hybrid.state.read_s == pytest.approx((0.5 - 0.02) / 98)
    hybrid.state.plain_s = 0.03
    assert hybrid.state.read_cost() == pytest.approx(hybrid.state.read_s / 0.03)
