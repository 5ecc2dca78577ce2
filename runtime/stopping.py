"""When a sequence is done, and which streamed text may be shown.

Stop strings are matched on text, not tokens, because a string like "\\n\\n" or "THE END" can
be split over tokens in many ways. Streaming makes that subtle: text that could be the start
of a stop string must be held back until it is known not to be one, or the user would see half
of a stop string that is then trimmed. The stop string itself is never emitted.

Usage (one `StopState` per sequence; speculative steps feed accepted tokens one by one and stop
feeding when ``done``)::

    state = criteria.new_state()
    for token in accepted:
        out.write(state.update(token, detok.add(token)))
        if state.done:
            break
    out.write(state.flush())   # only needed if the loop ended without `done`
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from specport.core.errors import InputError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StopCriteria:
    """Settings shared by all sequences of a request."""

    eos_ids: set[int] = field(default_factory=set)
    stop_strings: list[str] = field(default_factory=list)
    max_new_tokens: int = 256

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int):
            raise InputError(f"max_new_tokens must be an integer, got {self.max_new_tokens!r}")
        if self.max_new_tokens < 0:
            raise InputError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if any(not isinstance(s, str) or s == "" for s in self.stop_strings):
            raise InputError(f"stop strings must be non-empty strings, got {self.stop_strings!r}")

    def is_eos(self, token_id: int) -> bool:
        """True for a token that ends the sequence by itself."""
        return int(token_id) in self.eos_ids

    def new_state(self) -> StopState:
        """Fresh per-sequence state."""
        return StopState(self)

    def holdback(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for stop in self.stop_strings:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best


class StopState:
    """Tracks one sequence: tokens generated, held-back text, and why it finished.

    ``reason`` is ``"eos"``, ``"stop_string"``, ``"length"`` or None while running;
    ``matched`` is the stop string that fired (for ``"stop_string"``).
    """

    def __init__(self, criteria: StopCriteria) -> None:
        self.criteria = criteria
        self.num_tokens = 0
        self.pending = ""  # text received but not yet emitted (possible stop-string prefix)
        self.reason: str | None = "length" if criteria.max_new_tokens == 0 else None
        self.matched: str | None = None

    @property
    def done(self) -> bool:
        return self.reason is not None

    def update(self, token_id: int, text: str = "") -> str:
        """Count one generated token and its streamed text; return the text safe to show.

        After ``done`` turns True further calls are ignored and return "".
        """
        if self.done:
            return ""
        self.num_tokens += 1
        if self.criteria.is_eos(token_id):
            self.reason = "eos"
            return self._release_all()
        self.pending += text
        emitted = self._scan()
        if not self.done and self.num_tokens >= self.criteria.max_new_tokens:
            self.reason = "length"
            emitted += self._release_all()
        return emitted

    def flush(self) -> str:
        """Release held-back text (the stream ended without a stop string completing)."""
        if self.reason == "stop_string":
            return ""
        return self._release_all()

    def _scan(self) -> str:
        """Emit what cannot belong to a stop string; stop at the earliest full match."""
        first: tuple[int, str] | None = None
        for stop in self.criteria.stop_strings:
            idx = self.pending.find(stop)
            if idx >= 0 and (first is None or idx < first[0]):
                first = (idx, stop)
        if first is not None:
            idx, stop = first
            out = self.pending[:idx]
            self.pending = ""
            self.reason = "stop_string"
            self.matched = stop
            return out
        keep = self.criteria.holdback(self.pending)
        cut = len(self.pending) - keep
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out

    def _release_all(self) -> str:
        out, self.pending = self.pending, ""
        return out
