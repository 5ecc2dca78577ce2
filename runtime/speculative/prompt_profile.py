"""What a request's own prompt says about drafting from it, measured before its first step.

``--speculative auto`` drafts from the request's own text (prompt lookup: ``suffix.py``'s
``own-long`` and ``own-short`` matches) where that pays. Whether it pays differs per request:
an article to summarise, a passage to answer from, code to edit repeat their own phrases;
random tokens or a short open question repeat nothing. The prompt itself is a sample of the
text the request works on, so ``profile_prompt`` *replays* own-text drafting over the
prompt's latest ``WINDOW`` positions: at each, the draft a match on the text before it would
make, scored against the prompt's next tokens, per kind of match and per draft position (as
the hybrid scores its drafts while decoding). That costs one vectorised suffix search per
replayed position, a few milliseconds on a long prompt, against a prefill of hundreds.

The hybrid (``hybrid.HybridProposer``) adds the replay to its own-text estimates before the
request's first step (the estimates so far count for ``PSEUDO`` tests, so a long prompt's
evidence outweighs what earlier requests left, and a short prompt's barely moves it), and
lets a request whose prompt copies well (``copy_heavy``) draft up to its full cap, where other
requests stop at ``OPEN_DRAFT``. Decoding then corrects the estimates from the answer's own
tokens, step by step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from specport.runtime.speculative.ngram import copy_after, find_suffix_match

WINDOW = 256  # the prompt's latest positions replayed
HISTORY = 4096  # the most prompt tokens a replayed match searches (bounds the cost)
MAX_N = 6  # the longest suffix a match tries (``SuffixIndex``'s default max_n)
LONG_N = 3  # a match this long or longer is ``own-long`` (as ``SuffixProposer.match``)
REPLAY_DRAFT = 16  # draft positions scored per replayed match
PSEUDO = 8.0  # tests the priors count for when blended with the replay
PASSAGE_TOKENS = 400  # a prompt this long, with phrases of its own that recur, carries a
PASSAGE_MATCHES = 4  # passage the answer may copy from (random tokens recur in none)
COPY_RATE = 0.5  # replayed own-long acceptance at position 0 that makes a request copy-heavy
COPY_MATCHES = 16  # own-long matches the replay needs before it calls a request copy-heavy
OPEN_DRAFT = 8  # the draft cap of a request that is not copy-heavy


@dataclass
class PromptProfile:
    """The replay of own-text drafting over a prompt: per kind of match (``own-long``,
    ``own-short``), the positions where one was found and, per draft position, the drafts
    tested and accepted (a position is tested when every draft before it was accepted)."""

    tokens: int
    replayed: int
    matches: dict[str, int] = field(default_factory=dict)
    tested: dict[str, list[int]] = field(default_factory=dict)
    accepted: dict[str, list[int]] = field(default_factory=dict)

    def rates(self, kind: str, prior: Sequence[float]) -> list[float]:
        """Per draft position: P(accepted | the drafts before it accepted), the replay's counts
        blended with ``prior`` (the estimate so far, per position) weighing ``PSEUDO`` tests."""
        tested = self.tested.get(kind, [])
        accepted = self.accepted.get(kind, [])
        out = []
        for i, p in enumerate(prior):
            n = tested[i] if i < len(tested) else 0
            a = accepted[i] if i < len(accepted) else 0
            out.append((a + float(p) * PSEUDO) / (n + PSEUDO))
        return out

    @property
    def copy_rate(self) -> float:
        """Replayed acceptance of an own-long match's first draft (0 when none was tested)."""
        tested = self.tested.get("own-long", [0])
        return self.accepted.get("own-long", [0])[0] / tested[0] if tested[0] else 0.0

    @property
    def copy_heavy(self) -> bool:
        """Long drafts may pay: the prompt carries a passage (``PASSAGE_TOKENS`` or more, in
        which ``PASSAGE_MATCHES`` three-token phrases recur), or its own-long matches came true
        at least ``COPY_RATE`` of the time over ``COPY_MATCHES`` matches or more."""
        long = self.matches.get("own-long", 0)
        if self.tokens >= PASSAGE_TOKENS and long >= PASSAGE_MATCHES:
            return True
        return long >= COPY_MATCHES and self.copy_rate >= COPY_RATE

    def as_dict(self) -> dict[str, Any]:
        """What ``metrics["speculative"]["prompt"]`` reports."""
        return {
            "tokens": self.tokens,
            "replayed": self.replayed,
            "matches": dict(self.matches),
            "copy_rate": round(self.copy_rate, 3),
            "copy_heavy": self.copy_heavy,
        }


def profile_prompt(prompt: Sequence[int], window: int = WINDOW) -> PromptProfile:
    """Replay own-text drafting over ``prompt``'s last ``window`` positions (module docstring)."""
    ids = np.asarray(prompt, dtype=np.int64)
    n = int(ids.shape[0])
    start = max(2, n - int(window))
    out = PromptProfile(tokens=n, replayed=max(0, n - start))
    for kind in ("own-long", "own-short"):
        out.matches[kind] = 0
        out.tested[kind] = [0] * REPLAY_DRAFT
        out.accepted[kind] = [0] * REPLAY_DRAFT
    for i in range(start, n):
        before = ids[max(0, i - HISTORY) : i]
        match = find_suffix_match(before, 1, MAX_N)
        if match is None:
            continue
        kind = "own-long" if match[1] >= LONG_N else "own-short"
        draft = copy_after(before, match[0], min(REPLAY_DRAFT, n - i))
        out.matches[kind] += 1
        for j, tok in enumerate(draft):
            out.tested[kind][j] += 1
            if tok != int(ids[i + j]):
                break
            out.accepted[kind][j] += 1
    return out
