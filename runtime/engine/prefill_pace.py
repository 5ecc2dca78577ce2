"""How many prompt tokens a round may prefill while other requests decode, from measured costs.

A round runs its prefill before the decoding rows' next step, so every prompt token it takes
delays the running streams' next token. A fixed chunk cannot be right everywhere: on
SmolLM2-135M fp32 (2 threads) a 256-token chunk costs ~1 s against a ~36 ms decode step of 4
rows, so a long prompt arriving stalled those streams 32x their usual gap. vLLM bounds the
same thing with a token budget per step (`max_num_batched_tokens`, decode tokens included);
on a CPU the cost per token is what varies (the model, the threads, the machine's load, the
prompt's position), so the budget here is in time: a round's prefill may cost at most
`(stall - 1)` decode steps, the tokens that fit that from the costs the engine measures:

- the decode step: an average of the engine's recent plain steps (their batch as it is);
- a prefill run: `base + per_token x tokens`, fitted over the recent runs (their padded tokens,
  their seconds; later chunks of a long prompt cost more per token as their past grows, and the
  window follows that). Until runs of two sizes are seen, the whole run counts per token, and
  the budget never goes past twice the largest run timed (a line fitted on close sizes can
  promise much more than it saw).

Those two predict a round; what the streams wait is the whole round as it ran (the prefill
run, their step after it, the engine's host work), and the prediction came out short: on the
5.35-bit SmolLM2 beside a 2,500-token prompt (2 threads), rounds asked for 6 usual gaps took
7.0-7.3, and the worst reached 9.0 (`benchmarks/long_prompt_stall.py`). So the engine also
reports every round's wall time (`observe_round`): rounds without prompt tokens give the usual
gap, which the budget is counted in, and rounds with them give how far each run's real cost
(the round less a usual one) lay from the prediction for its tokens; the budget is divided by
the median of those factors over recent rounds. While a prompt goes in by pieces, each round
after the first takes its size from the round before it instead: its tokens scaled by how far
that round's real cost lay from the allowed one (at most doubling, at least halving), which
follows a cost per token that grows with the prompt's past and cannot overshoot much when a
fit's error changes with the run's size (over HTTP, rounds sized by the corrected fit alone
still reached 9.0-10.8 gaps as the first runs of a prompt left the fit's window).

Before any measurement (a fresh engine) the budget is `first` tokens, small enough to stall
little, and the runs it makes are the first measurements. At least `floor` tokens run per round
so a long prompt always gets on; `stall` None turns pacing off (the fixed budget alone).
"""

from __future__ import annotations

from collections import deque

from specport.runtime.engine.step_cost import StepCost

# A decoding stream's gap while prompts prefill, in its usual gaps, at most. 6 rather than 4:
# measured beside a 2,500-token prompt (SmolLM2 fp32, load 13-15) 4 and 6 gave the same worst
# gap (1.8 s, the machine's own stalls) and 6 the prompt's first token 41% sooner; and at 50
# decoding rows (~260 ms a step on the line step_cost.py quotes) 6 still lets a round take ~360
# prompt tokens, nearer the 512 that kept TTFT p99 down at 64 concurrent requests
# (batching.PREFILL_BUDGET) than 4's ~210.
STALL = 6.0
FIRST = 32  # tokens of the first round, before any run was timed
FLOOR = 8  # tokens a round prefills at least: a long prompt always gets on
WINDOW = 16  # recent runs the costs are taken from
# bounds on the correction from measured rounds: a few odd rounds (a page fault storm, another
# process's burst) must not shut prefill out or let it run unpaced
MISS_MIN, MISS_MAX = 0.5, 4.0
# rounds the correction is taken from: few, since the fit's error changes with the run's size
# (a line fitted on the small first runs under-predicts the larger ones that follow); over 16
# rounds the first uncapped rounds of a long prompt overshot to 9.5-10.3 gaps for 8 rounds
MISS_WINDOW = 5
# the share of the allowed cost a prompt's first piece asks for: the pieces after it double up
# to the whole. Asked for all of it, the first piece of the next prompt over HTTP stalled the
# streams 8.9-9.7 gaps against 6 (the fit and its corrections came from the previous prompt's
# deeper, dearer pieces)
FIRST_PIECE = 0.5


class PrefillPace:
    """The prefill budget of a round while rows decode (see the module docstring)."""

    def __init__(self, stall: float | None = STALL, first: int = FIRST, floor: int = FLOOR) -> None:
        self.stall, self.first, self.floor = stall, first, floor
        self.decode: deque[float] = deque(maxlen=WINDOW)
        self.prefill: deque[tuple[int, float]] = deque(maxlen=WINDOW)
        self.rounds: deque[float] = deque(maxlen=WINDOW)  # whole rounds without prompt tokens
        self.misses: deque[float] = deque(maxlen=MISS_WINDOW)  # real / predicted prefill cost
        self.last: tuple[int, float] | None = None  # the last round's (tokens, real cost)

    def observe_decode(self, seconds: float) -> None:
        self.decode.append(seconds)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        self.prefill.append((tokens, seconds))

    def observe_round(self, seconds: float, prompt_tokens: int) -> None:
        """A whole round's wall time while rows decode (a stream's gap), with the prompt
        tokens it prefilled (0: a usual round)."""
        if prompt_tokens <= 0:
            self.rounds.append(seconds)
            self.last = None
            return
        if not self.rounds or not self.prefill:
            return
        cost = seconds - _median(self.rounds)
        self.last = (prompt_tokens, cost)
        predicted = self._cost(prompt_tokens)
        if predicted > 0.0:
            self.misses.append(cost / predicted)

    def _fit(self) -> tuple[float, float]:
        """(base, per_token) of a prefill run from the recent runs. A line needs runs of
        different sizes: over sizes within 2x of each other (a long prompt's chunks, once the
        first small runs left the window) its slope is noise, and one that came out low let
        the next rounds overshoot to 9-10 gaps; there the whole run counts per token."""
        sizes = [n for n, _ in self.prefill]
        if max(sizes) < 2 * min(sizes):
            return 0.0, _median(deque(s / n for n, s in self.prefill))
        cost = StepCost.fit([(1 + n, s) for n, s in self.prefill])  # base + per_token x n
        if cost.per_token <= 0.0:
            return 0.0, max(s / n for n, s in self.prefill)
        return cost.base, cost.per_token

    def _cost(self, tokens: int) -> float:
        base, per_token = self._fit()
        return base + per_token * tokens

    def budget(self, limit: int) -> int:
        """Prompt tokens this round may prefill, at most `limit` (the fixed budget)."""
        if self.stall is None:
            return limit
        if not self.decode or not self.prefill:
            return max(1, min(limit, self.first))
        # a usual gap: a whole round when rounds were timed, else the step (median: one
        # stall is not a trend)
        usual = _median(self.rounds) if self.rounds else _median(self.decode)
        allowed = (self.stall - 1.0) * usual
        if self.last is not None:  # the prompt's previous piece, scaled to what it cost
            tokens, cost = self.last
            scaled = tokens * min(2.0, max(0.5, allowed / max(cost, 1e-9)))
            return max(self.floor, min(limit, int(scaled)))
        allowed *= FIRST_PIECE  # a prompt's first piece: the fit's size errors are unmeasured
        if self.misses:  # the predictions' measured shortfall (or surplus), within bounds
            allowed /= min(MISS_MAX, max(MISS_MIN, _median(self.misses)))
        base, per_token = self._fit()
        fitted = (allowed - base) / per_token
        fitted = min(fitted, 2.0 * max(n for n, _ in self.prefill))
        return max(self.floor, min(limit, int(fitted)))


def _median(values: deque[float]) -> float:
    return sorted(values)[len(values) // 2]
