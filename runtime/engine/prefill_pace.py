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


class PrefillPace:
    """The prefill budget of a round while rows decode (see the module docstring)."""

    def __init__(self, stall: float | None = STALL, first: int = FIRST, floor: int = FLOOR) -> None:
        self.stall, self.first, self.floor = stall, first, floor
        self.decode: deque[float] = deque(maxlen=WINDOW)
        self.prefill: deque[tuple[int, float]] = deque(maxlen=WINDOW)

    def observe_decode(self, seconds: float) -> None:
        self.decode.append(seconds)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        self.prefill.append((tokens, seconds))

    def budget(self, limit: int) -> int:
        """Prompt tokens this round may prefill, at most `limit` (the fixed budget)."""
        if self.stall is None:
            return limit
        if not self.decode or not self.prefill:
            return max(1, min(limit, self.first))
        step = sorted(self.decode)[len(self.decode) // 2]  # median: one stall is not a trend
        allowed = (self.stall - 1.0) * step
        cost = StepCost.fit([(1 + n, s) for n, s in self.prefill])  # base + per_token x n
        if cost.per_token <= 0.0:  # one size seen so far: the whole run per token
            per_token = max(s / n for n, s in self.prefill)
            tokens = allowed / per_token
        else:
            tokens = (allowed - cost.base) / cost.per_token
        tokens = min(tokens, 2 * max(n for n, _ in self.prefill))
        return max(self.floor, min(limit, int(tokens)))
