"""The hand-off between a proposer and the verifier.

A proposer only says which tokens it guesses (and, if it is a model, with which
probabilities); the verifier only sees that and the target's logits. Keeping the contract this
small is what lets the generator swap n-gram, MTP and draft-model proposers freely.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from specport.core.errors import ContextLengthError, InputError

if TYPE_CHECKING:
    from specport.runtime.sampler import SamplingConfig

logger = logging.getLogger(__name__)

PAD = -1  # filler in `Drafts.tokens` past a row's length


@dataclass
class Drafts:
    """Draft tokens for a batch, right-padded with -1 to a common width K."""

    tokens: np.ndarray  # [B, K] int64, PAD past lengths[b]
    lengths: np.ndarray  # [B] int64, 0 <= lengths[b] <= K
    probs: np.ndarray | None = None  # [B, K, V] draft distributions, None for deterministic drafts
    # one row's drafts as a token tree (``token_tree.TokenTree``: tokens are its nodes after the
    # root, each with its parent); None for a chain
    tree: Any = None

    def __post_init__(self) -> None:
        self.tokens = np.asarray(self.tokens, dtype=np.int64).reshape(len(self.lengths), -1)
        self.lengths = np.asarray(self.lengths, dtype=np.int64)
        if self.lengths.ndim != 1 or self.tokens.shape[0] != self.lengths.shape[0]:
            raise ValueError(
                f"tokens {self.tokens.shape} and lengths {self.lengths.shape} disagree on batch"
            )
        if np.any(self.lengths < 0) or np.any(self.lengths > self.tokens.shape[1]):
            raise ValueError(f"lengths {self.lengths.tolist()} outside [0, {self.tokens.shape[1]}]")
        if self.probs is not None and self.probs.shape[:2] != self.tokens.shape:
            raise ValueError(f"probs {self.probs.shape} do not match tokens {self.tokens.shape}")

    @property
    def batch_size(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def width(self) -> int:
        """K: the number of draft slots the target has to score (plus one bonus position)."""
        return int(self.tokens.shape[1])

    def row(self, b: int) -> list[int]:
        """Row b's draft tokens without padding."""
        return self.tokens[b, : self.lengths[b]].tolist()

    @classmethod
    def from_lists(cls, rows: list[list[int]], probs: np.ndarray | None = None) -> Drafts:
        """Pack ragged rows (e.g. from a proposer) into a padded batch."""
        width = max((len(r) for r in rows), default=0)
        tokens = np.full((len(rows), width), PAD, dtype=np.int64)
        for b, r in enumerate(rows):
            tokens[b, : len(r)] = r
        return cls(tokens, np.array([len(r) for r in rows], dtype=np.int64), probs)

    @classmethod
    def one(cls, row: list[int]) -> Drafts:
        """One row of drafts (ints), without the general constructor's checks: the batch-1
        loops build one of these every step."""
        drafts = cls.__new__(cls)
        drafts.tokens = np.array([row], dtype=np.int64).reshape(1, len(row))
        drafts.lengths = np.array([len(row)], dtype=np.int64)
        drafts.probs = None
        drafts.tree = None
        return drafts

    @classmethod
    def empty(cls, batch_size: int) -> Drafts:
        """No drafts for anyone (a plain decode step)."""
        return cls(np.zeros((batch_size, 0), dtype=np.int64), np.zeros(batch_size, np.int64))

    @classmethod
    def make_dummy(cls, batch_size: int, width: int, vocab_size: int, seed: int = 0) -> Drafts:
        """Random full-width drafts with random draft distributions, for tests."""
        rng = np.random.default_rng(seed)
        logits = rng.standard_normal((batch_size, width, vocab_size))
        probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
        tokens = np.array(
            [
                [rng.choice(vocab_size, p=probs[b, k]) for k in range(width)]
                for b in range(batch_size)
            ],
            dtype=np.int64,
        ).reshape(batch_size, width)
        return cls(tokens, np.full(batch_size, width, dtype=np.int64), probs)


@runtime_checkable
class Proposer(Protocol):
    """Guesses the next tokens of a sequence; the loop verifies them and tells it the verdict.

    Every loop (batch-1 chain, token tree, batched, the serving engine) drives a proposer only
    through this protocol and never asks which proposer it has; what differs between proposers
    is stated by their attributes:

    * ``adaptive_default``: adaptive draft length is on by default (chosen by measurement);
    * ``needs_outputs``: its next drafts come out of the target's run (MTP heads), so a row
      that decodes plainly must still show it that run's outputs;
    * ``graph_verifies``: the target graph verifies its drafts itself (an MTP branch computes
      the greedy accepted prefix and bonus token), so greedy loops may trust that verdict.
    """

    name: str
    adaptive_default: bool
    needs_outputs: bool
    graph_verifies: bool

    def start(
        self, sampling: SamplingConfig | None, stream: int | None = None, budget: int | None = None
    ) -> None:
        """A new request begins: forget the last one, draft for these settings (``stream``
        separates the random streams of a batch's rows; ``budget``: the most new tokens it may
        make, None when unknown, for drafters whose setup is worth it only on a long answer)."""
        ...

    def propose(self, context: list[list[int]], num_draft: int) -> Drafts:
        """Up to ``num_draft`` drafts per row, given every row's tokens so far."""
        ...

    def observe(self, outputs: dict[str, np.ndarray], result: Any) -> None:
        """The verdict on the last drafts (a ``VerifyResult``) and the run's extra outputs."""
        ...

    def draft_cost(self, target: Any) -> float:
        """What one draft costs relative to a target step (0 for free drafters), a prior for
        the adaptive draft length (``target``: the target's manifest)."""
        ...

    def share_target_kv(self, cache: Any, row: int) -> bool:
        """The request decodes in row ``row`` of the target's KV ``cache`` (after ``start``,
        and again whenever the row may have moved): a drafter whose layers are the target's
        first ones (cut or quantized from it) may read the target's cached positions instead
        of computing its own; True when it does."""
        ...

    def finish(self, answer: Sequence[int]) -> None:
        """The request ended with ``answer`` (a corpus-backed drafter may learn it)."""
        ...


class ProposerBase:
    """Defaults for the ``Proposer`` protocol: stateless, free, host-verified."""

    name = "custom"
    adaptive_default = False
    needs_outputs = False
    graph_verifies = False

    def start(
        self, sampling: SamplingConfig | None, stream: int | None = None, budget: int | None = None
    ) -> None:
        return None

    def propose(self, context: list[list[int]], num_draft: int) -> Drafts:
        raise NotImplementedError

    def observe(self, outputs: dict[str, np.ndarray], result: Any) -> None:
        return None

    def draft_cost(self, target: Any) -> float:
        return 0.0

    def share_target_kv(self, cache: Any, row: int) -> bool:
        return False

    def finish(self, answer: Sequence[int]) -> None:
        return None


class RowProposer(ProposerBase):
    """A proposer that drafts each context row alone, from its tokens only (`propose_one`), at
    most `max_draft` tokens: the n-gram and suffix matchers."""

    max_draft: int

    def propose(self, context: list[list[int]], num_draft: int) -> Drafts:
        """One draft row per context row (possibly empty when nothing matches)."""
        k = min(int(num_draft), self.max_draft)
        if k <= 0:
            return Drafts.empty(len(context))
        if len(context) == 1:
            return Drafts.one(self.propose_one(context[0], k))
        return Drafts.from_lists([self.propose_one(row, k) for row in context])

    def propose_one(self, tokens: list[int], num_draft: int) -> list[int]:
        raise NotImplementedError


class _Adopted(ProposerBase):
    """A caller's proposer with only part of the protocol (``propose``, maybe ``observe``,
    ``reset``, ``configure``): the defaults fill in the rest."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.name = str(getattr(inner, "name", "custom"))
        for attr in ("adaptive_default", "needs_outputs", "graph_verifies"):
            setattr(self, attr, bool(getattr(inner, attr, False)))

    def __getattr__(self, attr: str) -> Any:  # e.g. tests reading the caller's own fields
        return getattr(self.inner, attr)

    def start(
        self, sampling: SamplingConfig | None, stream: int | None = None, budget: int | None = None
    ) -> None:
        configure = getattr(self.inner, "configure", None)
        if configure is not None:
            configure(sampling)
        reset = getattr(self.inner, "reset", None)
        if reset is not None:
            reset()

    def propose(self, context: list[list[int]], num_draft: int) -> Drafts:
        return self.inner.propose(context, num_draft)  # type: ignore[no-any-return]

    def observe(self, outputs: dict[str, np.ndarray], result: Any) -> None:
        observe = getattr(self.inner, "observe", None)
        if observe is not None:
            observe(outputs, result)


def adopt(proposer: Any) -> Proposer:
    """``proposer`` as a full ``Proposer``: the project's proposers as they are, a caller's
    partial one (only ``propose``) wrapped once, so no loop checks what it was given."""
    if isinstance(proposer, ProposerBase):
        return proposer  # type: ignore[return-value]
    return _Adopted(proposer)  # type: ignore[return-value]


def stop_reason(
    token: int,
    produced: int,
    eos: set[int] | frozenset[int],
    on_token: Any,
    budget: int,
    max_new_tokens: int,
) -> str | None:
    """Why generation ends at this emitted token (``produced`` tokens so far), or None.

    One rule for every speculative loop, so they all stop exactly where plain decoding would:
    EOS first, then a caller's stop (e.g. a stop string), then the token budget (``context``
    when the context window, not ``max_new_tokens``, set it)."""
    if token in eos:
        return "eos"
    if on_token is not None and on_token(token):
        return "stop"
    if produced >= budget:
        return "context" if budget < max_new_tokens else "length"
    return None


def check_int_range(value: Any, option: str, limit: int) -> int:
    """``value`` as an int in 1..limit, or an InputError naming the CLI option."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, np.integer))
        or not 1 <= value <= limit
    ):
        raise InputError(f"{option} must be an integer in 1..{limit}, got {value!r}.")
    return int(value)


def check_prompts(
    prompts: Sequence[Sequence[int]], max_new_tokens: int, context_length: int, vocab_size: int
) -> list[list[int]]:
    """Prompts as int lists, or the error a user can act on (the same for every loop)."""
    if not prompts:
        raise InputError("give at least one prompt (the prompt list is empty).")
    rows = [[int(t) for t in p] for p in prompts]
    if any(not r for r in rows):
        raise InputError("every prompt needs at least one token.")
    if isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise InputError("--max-new-tokens must be at least 1.")
    for r in rows:
        bad = [t for t in r if not 0 <= t < vocab_size]
        if bad:
            raise InputError(
                f"token ids {bad[:5]} are outside the vocabulary (0..{vocab_size - 1})."
            )
    longest = max(len(r) for r in rows)
    if longest >= context_length:
        raise ContextLengthError(
            f"a prompt has {longest} tokens but the model's context window is {context_length} "
            f"(and at least one new token must fit). Shorten it to at most "
            f"{context_length - 1} tokens."
        )
    return rows
