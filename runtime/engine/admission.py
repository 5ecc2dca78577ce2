"""What a request reserves of the KV space, by preemption mode (``serve --preemption-mode``).

``none`` (the default): a request reserves its worst case when it is admitted, its prompt plus
its token budget (``max_tokens``), so no running request ever runs out of KV space and none is
ever preempted (``kv_budget``). Most answers stop well before ``max_tokens``, so the space
holds back requests for tokens that are never written: on the chat workload (prompts of
100-1,000 tokens, answers of 128-512, SmolLM2-135M fp32, 2 GiB of KV, 64 concurrent requests)
the first token's p99 was 70 s against vLLM's 25 s (2026-12-06).

``recompute``: vLLM's scheduling. A request is admitted while what the running requests hold
now fits: its prompt plus a headroom of ``HEADROOM_STEPS`` decode steps, and each running
request's reservation grows by whole blocks of ``BLOCK`` positions as its row fills (a step
writes ``lookahead`` positions a row: 1, or 1 + drafts when the engine speculates, a verify's
positions). When the reservations would overrun the space, the most recently admitted
request is preempted (vLLM's LIFO: the oldest keep going, so every request finishes), never
the only running one: it goes back to the front of the waiting queue and, readmitted,
prefills its prompt and the tokens it has so far but the last (its row's KV stays there for
the prefix cache until the space needs it, which under the pressure that preempted it is
usually at once) and goes on with the step it would have run. Its stream, sampler and
drafting state stay with it, so its client sees no token twice and greedy or seeded output
is the one it gets without preemption. In a round that preempts no request is admitted
(vLLM's rule), and the preempted one, first in the queue, waits until its reservation fits.
"""

from __future__ import annotations

from dataclasses import dataclass

PREEMPTION_MODES = ("none", "recompute")
# The default, as vLLM's: on SmolLM2-135M fp32, 2 threads, 2 GiB of KV, chat requests (prompts
# 100-1,000 tokens, answers 128-512), one run beside vLLM 0.32: at 64 in flight 238 output
# tok/s and TTFT p99 24.7 s against 223 and 64.4 s with "none" (vLLM 230 and 24.8 s); at 16,
# 196 against 184 (docs/benchmarks/2026-12-06-preemption.md).
DEFAULT_PREEMPTION = "recompute"
BLOCK = 16  # positions a running request's reservation grows by (vLLM's default block size)
HEADROOM_STEPS = 4  # decode steps a request has room for when it is admitted or grows


@dataclass(frozen=True)
class Admission:
    """The reservation rule of one preemption mode (see the module docstring)."""

    preemption: str  # one of PREEMPTION_MODES
    max_length: int  # a row's positions
    lookahead: int = 1  # positions one decode step writes per row (1 + drafts)

    @property
    def preempts(self) -> bool:
        return self.preemption == "recompute"

    def start(self, fill: int, worst: int) -> int:
        """Positions a request reserves when it is admitted: `fill` the positions it prefills
        (its prompt, plus what it generated before a preemption), `worst` its prompt plus its
        token budget."""
        if not self.preempts:
            return worst
        return self._cover(fill + HEADROOM_STEPS * self.lookahead, worst)

    def grow(self, held: int, reserved: int, worst: int) -> int:
        """What a decoding row holding `held` positions reserves before its next step:
        `reserved` while it covers the step, else whole blocks for a few more steps."""
        if not self.preempts or held + self.lookahead <= reserved:
            return reserved
        return self._cover(held + HEADROOM_STEPS * self.lookahead, worst)

    def _cover(self, positions: int, worst: int) -> int:
        """`positions` rounded up to whole blocks, at most what the row can come to write (a
        step's padding past the last fed token included) and its length."""
        most = min(self.max_length, worst + self.lookahead - 1)
        return min(most, -(-positions // BLOCK) * BLOCK)
