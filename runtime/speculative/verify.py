"""Decide which draft tokens the target model agrees with: every verifier, in one module.

The verifier never learns which proposer drafted: it sees the drafts (``Drafts``: ids, optional
draft distributions) and the target's scores at the K+1 positions (after each of the K drafts
prefixes, plus one past the last draft). Per row it returns

* **accepted** tokens: the longest prefix of the drafts that passed verification
  (``VerifyResult.accepted[b]`` of them);
* then exactly one extra token, which is either
  * a **recovered** token, drawn at the first rejected position in place of the rejected draft
    (greedy: the target's argmax; sampling: a draw from ``norm(max(0, p - q))``), or
  * a **bonus** token, drawn from the target at position ``lengths[b]`` when every draft was
    accepted (a free token: the target scored that position anyway).

So a row always gains ``accepted[b] + 1`` tokens, and with a target that is exactly the
distribution the sampler would use, the output distribution equals plain sampling from the
target (Leviathan et al. 2023; Chen et al. 2023).

Which rule applies is decided ONCE per request from its sampling settings (``make_verifier``):

* ``GreedyVerifier``: greedy without a penalty, exact argmax match (the common case, kept lean);
* ``ProcessedGreedyVerifier``: greedy with a repetition penalty, argmax of the processed
  scores, each position seeing the context plus the drafts before it;
* ``RejectionVerifier``: sampling, lossless rejection sampling with the request's RNG;
* ``GrammarVerifier``: greedy under a grammar (structured outputs), a draft the grammar
  forbids is never accepted.

* ``GraphVerifier``: plain greedy with a proposer whose graph verifies its drafts itself (an
  MTP branch computes the accepted prefix and the bonus token in the same run): the verdict
  is read from the run's outputs (``graph_verdict``) instead of recomputed on the host.

Each verifies a chain (``chain``, which also sees the run's other outputs) or a token tree
(``tree``: the accepted root path and the extra token). Loops, the batched generator and the
serving engine all verify through here; none of them knows these rules.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from specport.core.errors import InputError
from specport.runtime.sampler import Sampler, sample_from_probs
from specport.runtime.speculative.base import Drafts

if TYPE_CHECKING:
    from specport.runtime.speculative.token_tree import TokenTree

logger = logging.getLogger(__name__)

Outputs = Mapping[str, np.ndarray]  # a run's extra graph outputs by name
# The run's argmax at every scored position ([B, S] ids), when the graph computes it: the step
# passes it among the outputs, and greedy verification reads it instead of repeating the argmax
# over [S, V] scores on the host (about as much host time as the rest of a batch-1 step).
ARGMAX = "argmax"


@dataclass
class VerifyResult:
    """Per row: how many drafts were accepted, and the tokens to append."""

    accepted: np.ndarray  # [B] int64: drafts accepted (prefix length)
    tokens: list[list[int]]  # per row: accepted drafts + one recovered or bonus token
    bonus: np.ndarray  # [B] bool: True when the extra token is a bonus (all drafts accepted)
    paths: list[list[int]] | None = None  # token trees: per row the accepted nodes from the root

    @property
    def num_emitted(self) -> np.ndarray:  # [B]
        return self.accepted + 1


def _check(drafts: Drafts, target: np.ndarray, what: str) -> None:
    if target.ndim != 3 or target.shape[0] != drafts.batch_size:
        raise InputError(
            f"{what} must be [B={drafts.batch_size}, K+1, V], got {list(target.shape)}"
        )
    if target.shape[1] < drafts.width + 1:
        raise InputError(
            f"{what} cover {target.shape[1]} positions but {drafts.width} drafts need "
            f"{drafts.width + 1} (one per draft plus the bonus position)"
        )


def _valid(drafts: Drafts) -> np.ndarray:  # [B, K] bool: slot holds a real draft
    return np.arange(drafts.width)[None, :] < drafts.lengths[:, None]


def _assemble(drafts: Drafts, accepted: np.ndarray, extra: np.ndarray) -> VerifyResult:
    tokens = [[*drafts.tokens[b, : accepted[b]].tolist(), int(extra[b])] for b in range(len(extra))]
    return VerifyResult(accepted.astype(np.int64), tokens, accepted == drafts.lengths)


def greedy_verify(
    drafts: Drafts,
    target_logits: np.ndarray,  # [B, K+1, V]
) -> VerifyResult:
    """Exact greedy: accept drafts while they equal the target's argmax."""
    target_logits = np.asarray(target_logits)
    _check(drafts, target_logits, "target_logits")
    k = drafts.width
    best = np.argmax(target_logits[:, : k + 1], axis=-1)  # [B, K+1]
    match = (drafts.tokens == best[:, :k]) & _valid(drafts)
    accepted = np.cumprod(match, axis=1).sum(axis=1)
    extra = best[np.arange(drafts.batch_size), accepted]
    return _assemble(drafts, accepted, extra)


def rejection_verify(
    drafts: Drafts,
    target_probs: np.ndarray,  # [B, K+1, V] the distribution the sampler would draw from
    rng: np.random.Generator,
    draft_probs: np.ndarray | None = None,  # [B, K, V]; None -> drafts.probs
) -> VerifyResult:
    """Lossless speculative sampling.

    Draft x at position i is accepted with probability ``min(1, p_i(x) / q_i(x))``; at the
    first rejection the recovered token is drawn from ``norm(max(0, p_i - q_i))``; if all are
    accepted the bonus token is drawn from ``p_K``. Without draft probabilities (an n-gram or
    other deterministic proposer) q is one-hot at x, so x is accepted with probability
    ``p_i(x)`` and the recovered token comes from p_i with x removed.

    RNG use is fixed per call (B*K uniforms, then B), so a seeded ``rng`` is reproducible.
    """
    target_probs = np.asarray(target_probs, dtype=np.float64)
    _check(drafts, target_probs, "target_probs")
    q = draft_probs if draft_probs is not None else drafts.probs
    n_rows, k = drafts.batch_size, drafts.width
    rows = np.arange(n_rows)
    tok = np.maximum(drafts.tokens, 0)[..., None]  # [B, K, 1]
    p_x = np.take_along_axis(target_probs[:, :k], tok, axis=-1)[..., 0]
    if q is not None:
        q = np.asarray(q, dtype=np.float64)
        if q.shape[:2] != (n_rows, k) or q.shape[2] != target_probs.shape[2]:
            raise InputError(
                f"draft_probs must be [B, K, V]={[n_rows, k]}+[V], got {list(q.shape)}"
            )
        q_x = np.take_along_axis(q, tok, axis=-1)[..., 0]
    else:
        q_x = np.ones_like(p_x)

    u = rng.random((n_rows, k))
    ok = (u * q_x < p_x) & _valid(drafts)
    accepted = np.cumprod(ok, axis=1).sum(axis=1)

    rejected = np.flatnonzero(accepted < drafts.lengths)
    dist = target_probs[rows, accepted]  # [B, V]: p at the extra token's position (a copy)
    if rejected.size:
        at = accepted[rejected]
        if q is not None:
            residual = np.maximum(dist[rejected] - q[rejected, at], 0.0)
        else:
            residual = dist[rejected].copy()
            residual[np.arange(rejected.size), drafts.tokens[rejected, at]] = 0.0
        # p == q up to rounding: rejection had probability ~0, keep sampling from p
        usable = residual.sum(axis=-1) > 0
        dist[rejected[usable]] = residual[usable]
    extra = sample_from_probs(dist, rng)
    return _assemble(drafts, accepted, extra)


def accept_prefix(row: Sequence[int], best: Sequence[int]) -> int:
    """How many leading drafts of ``row`` equal the target's choices ``best`` (the one
    "longest matching prefix" rule; ``best`` has at least ``len(row)`` entries)."""
    a, n = 0, len(row)
    while a < n and row[a] == best[a]:
        a += 1
    return a


def greedy_rows(
    drafts: Drafts, logits: np.ndarray, argmax: np.ndarray | None = None
) -> VerifyResult:
    """``greedy_verify`` for the few rows of one step: one argmax (the graph's ``argmax``
    [n, >= S] when given), then plain lists (logits [n, S, V]; cheaper than batch-wide masks
    below a few dozen rows)."""
    s = drafts.width + 1
    best = (np.argmax(logits[:, :s], axis=-1) if argmax is None else argmax[:, :s]).tolist()
    lengths = drafts.lengths.tolist()
    accepted, tokens = [], []
    for i, row in enumerate(drafts.tokens.tolist()):
        a = accept_prefix(row[: lengths[i]], best[i])
        accepted.append(a)
        tokens.append([*row[:a], best[i][a]])
    acc = np.array(accepted, dtype=np.int64)
    return VerifyResult(acc, tokens, acc == drafts.lengths)


def greedy_one(
    row: list[int], logits: np.ndarray, argmax: np.ndarray | None = None
) -> VerifyResult:
    """Exact greedy for one row: ``row`` drafts, ``logits`` [>= len(row)+1, V] (batch 1's fast
    path: one argmax over the fed positions, or the graph's ``argmax`` [>= len(row)+1] when
    given, no batch machinery)."""
    s = len(row) + 1
    best = (np.argmax(logits[:s], axis=-1) if argmax is None else argmax[:s]).tolist()
    a = accept_prefix(row, best)
    accepted = np.array([a], dtype=np.int64)
    return VerifyResult(accepted, [[*row[:a], int(best[a])]], np.array([a == len(row)]))


def graph_verdict(
    drafts: Drafts, accepted: Sequence[int], bonus: Sequence[int], filler: int = 0
) -> VerifyResult:
    """The verdict an MTP graph computed in-graph (its greedy argmax check, ``passes.mtp``) as
    a ``VerifyResult``: per row the accepted count and the bonus token.

    A batched graph compares every fed slot, fillers included: when a ``filler`` fed after a
    row's last real draft equals the argmax there, the graph accepts past it, while exact
    greedy stops at the row's drafts and emits that argmax (= the filler) as the extra token.
    """
    acc: list[int] = []
    tokens: list[list[int]] = []
    lengths = drafts.lengths.tolist()
    for i, row in enumerate(drafts.tokens.tolist()):
        n = lengths[i]
        a, extra = (int(accepted[i]), int(bonus[i])) if accepted[i] <= n else (n, filler)
        acc.append(a)
        tokens.append([*row[:a], extra])
    arr = np.array(acc, dtype=np.int64)
    return VerifyResult(arr, tokens, arr == drafts.lengths)


def constrained_greedy_verify(
    drafts: Drafts, logits: np.ndarray, sampler: Sampler, context: list[int]
) -> VerifyResult:
    """Greedy verification under a grammar, for one sequence (logits [1, K+1, V];
    ``sampler.config`` is greedy with a ``constraint``).

    Plain constrained greedy picks, at each position, the argmax of the logits masked by the
    grammar's state there. Verification does exactly that along the draft: at position i the
    mask is the grammar's state after the drafts accepted so far; draft i is accepted only when
    it is that masked argmax (a forbidden token never is, whatever the model thinks of it), and
    the first position where it is not gives the extra token. The grammar advances by exactly
    the tokens returned, so nothing is rolled back, and the output is plain constrained
    greedy's, token for token.
    """
    constraint = sampler.config.constraint
    penalized = sampler.config.repetition_penalty != 1.0
    row = drafts.row(0)
    a = 0
    while True:
        history = [np.asarray(context + row[:a], dtype=np.int64)] if penalized else None
        scores = constraint.mask(sampler.scores(logits[0, a : a + 1], history))
        best = int(np.argmax(scores[0]))
        constraint.accept(best)
        if a < len(row) and row[a] == best:
            a += 1
            continue
        break
    accepted = np.array([a], dtype=np.int64)
    return VerifyResult(accepted, [[*row[:a], best]], accepted == drafts.lengths)


class Verifier(Protocol):
    """Accepts drafts against target scores; one per request, chosen by ``make_verifier``."""

    name: str

    def chain(
        self,
        drafts: Drafts,
        logits: np.ndarray,
        contexts: Sequence[list[int]],
        outputs: Outputs | None = None,
    ) -> VerifyResult:
        """Drafts [B, K] against logits [B, >= K+1, V]; ``contexts[b]``: row b's tokens so far
        (the last one fed with the drafts); ``outputs``: the run's other outputs ([B, ...]),
        which only a verdict computed in the graph reads."""
        ...

    def tree(
        self, tree: TokenTree, logits: np.ndarray, context: list[int]
    ) -> tuple[list[int], int]:
        """(accepted node path from the root, the extra token) for a token tree scored in one
        run (logits [N, V], one row per node)."""
        ...


class GreedyVerifier:
    """Greedy without a penalty: accept drafts while they equal the target's argmax."""

    name = "greedy"

    def chain(
        self,
        drafts: Drafts,
        logits: np.ndarray,
        contexts: Sequence[list[int]] = (),
        outputs: Outputs | None = None,
    ) -> VerifyResult:
        argmax = None if outputs is None else outputs.get(ARGMAX)
        if drafts.batch_size == 1:
            return greedy_one(drafts.row(0), logits[0], None if argmax is None else argmax[0])
        return greedy_rows(drafts, logits, argmax)

    def tree(
        self, tree: TokenTree, logits: np.ndarray, context: list[int]
    ) -> tuple[list[int], int]:
        best = np.argmax(logits, axis=-1).tolist()
        path = [0]
        while (child := tree.children[path[-1]].get(best[path[-1]])) is not None:
            path.append(child)
        return path, int(best[path[-1]])


class _Processed:
    """Verification on the sampler's processed distributions (penalties see each position's
    own history: the context plus the drafts before it)."""

    name = "processed"

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def _probs(
        self, drafts: Drafts, logits: np.ndarray, contexts: Sequence[list[int]]
    ) -> np.ndarray:
        s = logits.shape[1]
        history = None
        if self.sampler.config.repetition_penalty != 1.0:
            history = [
                np.asarray(list(ctx) + drafts.row(b)[:j], dtype=np.int64)
                for b, ctx in enumerate(contexts)
                for j in range(s)
            ]
        return self.sampler.probs(logits, history)  # [B, S, V]

    def _node_probs(
        self, tree: TokenTree, logits: np.ndarray, context: list[int], path: list[int]
    ) -> np.ndarray:
        history = np.asarray(context + [tree.tokens[i] for i in path[1:]], dtype=np.int64)
        return self.sampler.probs(logits[path[-1]][None], [history])[0]  # [V] float64


class ProcessedGreedyVerifier(_Processed):
    """Greedy with a repetition penalty: exact argmax of the processed scores."""

    name = "greedy-processed"

    def chain(
        self,
        drafts: Drafts,
        logits: np.ndarray,
        contexts: Sequence[list[int]],
        outputs: Outputs | None = None,
    ) -> VerifyResult:
        return greedy_verify(drafts, self._probs(drafts, logits, contexts))

    def tree(
        self, tree: TokenTree, logits: np.ndarray, context: list[int]
    ) -> tuple[list[int], int]:
        path = [0]
        while True:
            tok = int(np.argmax(self._node_probs(tree, logits, context, path)))
            child = tree.children[path[-1]].get(tok)
            if child is None:
                return path, tok
            path.append(child)


class RejectionVerifier(_Processed):
    """Sampling: lossless rejection sampling with the request's seeded RNG."""

    name = "rejection"

    def chain(
        self,
        drafts: Drafts,
        logits: np.ndarray,
        contexts: Sequence[list[int]],
        outputs: Outputs | None = None,
    ) -> VerifyResult:
        return rejection_verify(drafts, self._probs(drafts, logits, contexts), self.sampler.rng)

    def tree(
        self, tree: TokenTree, logits: np.ndarray, context: list[int]
    ) -> tuple[list[int], int]:
        """Multi-round speculative sampling with one-hot drafts (SpecInfer): at a node the
        children are tried in order, each accepted with the current p(child); a rejected
        child's mass is removed and p renormalised (the chain rule of a single draw from p);
        when no child is accepted the token is drawn from what is left of p."""
        rng = self.sampler.rng
        path = [0]
        while True:
            p = self._node_probs(tree, logits, context, path)
            nxt = None
            for tok, child in tree.children[path[-1]].items():  # priority order
                if rng.random() < p[tok]:
                    nxt = child
                    break
                residual = p.copy()
                residual[tok] = 0.0
                mass = residual.sum()
                if mass <= 0:  # p == one-hot up to rounding: rejection had probability ~0
                    break
                p = residual / mass
            if nxt is None:
                return path, int(sample_from_probs(p[None], rng)[0])
            path.append(nxt)


class GrammarVerifier:
    """Greedy under a grammar (structured outputs); one sequence, chains only."""

    name = "grammar"

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def chain(
        self,
        drafts: Drafts,
        logits: np.ndarray,
        contexts: Sequence[list[int]],
        outputs: Outputs | None = None,
    ) -> VerifyResult:
        if drafts.batch_size != 1:
            raise InputError("grammar-constrained verification runs one sequence at a time")
        return constrained_greedy_verify(drafts, logits, self.sampler, list(contexts[0]))

    def tree(
        self, tree: TokenTree, logits: np.ndarray, context: list[int]
    ) -> tuple[list[int], int]:
        raise InputError(
            "structured outputs (a grammar) cannot verify token trees; use --tree-width 1."
        )


class GraphVerifier(GreedyVerifier):
    """Plain greedy whose chain verdict the target graph computed: an MTP branch takes the
    argmax of the verified logits, the accepted prefix and the bonus token in the same run
    (``passes.mtp``), so the host reads two small outputs instead of repeating it. Trees and
    runs without those outputs are verified on the host, with the same rule."""

    name = "greedy-graph"

    def __init__(self, accepted: str, bonus: str) -> None:
        self.accepted, self.bonus = accepted, bonus

    def chain(
        self,
        drafts: Drafts,
        logits: np.ndarray,
        contexts: Sequence[list[int]] = (),
        outputs: Outputs | None = None,
    ) -> VerifyResult:
        if not outputs or self.accepted not in outputs:
            return super().chain(drafts, logits, contexts, outputs)
        # a batched run pads a row's drafts with its last token (see ``graph_verdict``)
        filler = contexts[0][-1] if len(contexts) == 1 and contexts[0] else 0
        accepted = outputs[self.accepted].reshape(-1).tolist()  # [B] int64
        bonus = outputs[self.bonus].reshape(-1).tolist()  # [B] int64
        if drafts.batch_size == 1:  # batch 1's lean path: plain lists, no batch machinery
            row = drafts.row(0)
            a, extra = (accepted[0], bonus[0]) if accepted[0] <= len(row) else (len(row), filler)
            return VerifyResult(np.array([a]), [[*row[:a], extra]], np.array([a == len(row)]))
        return graph_verdict(drafts, accepted, bonus, filler)


def graph_outputs(manifest: Any) -> tuple[str, str] | None:
    """(accepted, bonus) output names of the artifact's in-graph verification (an MTP
    branch), or None when it has none."""
    out = (manifest.mtp or {}).get("outputs") or {}
    if out.get("accepted") and out.get("bonus"):
        return str(out["accepted"]), str(out["bonus"])
    return None


GREEDY = GreedyVerifier()


def make_verifier(sampler: Sampler | None, graph: tuple[str, str] | None = None) -> Verifier:
    """The verifier a request's sampling settings call for (None: plain greedy).

    ``graph``: the (accepted, bonus) outputs of a graph that verifies the drafts itself (an
    MTP branch, ``graph_outputs``): plain greedy decoding trusts its verdict."""
    if sampler is None:
        return GREEDY if graph is None else GraphVerifier(*graph)
    cfg = sampler.config
    if cfg.constraint is not None:
        return GrammarVerifier(sampler)
    if cfg.greedy and cfg.repetition_penalty == 1.0:
        return GREEDY if graph is None else GraphVerifier(*graph)
    if cfg.greedy:
        return ProcessedGreedyVerifier(sampler)
    return RejectionVerifier(sampler)
