"""EAGLE proposer: a small draft head reads the target's own hidden states and drafts a chain.

The artifact's target graph outputs ``eagle_features`` [B, S, 3H] (three layers' hidden
states at every fed position) in the same run that scores the drafts; ``eagle_draft.onnx`` is
the head, with its own one-layer KV cache (``exporter.eagle_artifact``). The proposer keeps:

* ``past``: the head's keys and values for every position it has seen real features of;
* ``pending``: features the loop showed it (``observe``) whose following token was not known
  yet, copied into one staging array (rows [0, n): what the next catch-up run reads, bound
  in place by ``eagle_kv``) - it is, at the next ``propose``: feature row i belongs to context position i and pairs
  with context token i+1, so the proposer needs no positions from the loop.

``propose``: one head run over the pending positions (their KV becomes real), which drafts
the first token; then one single-position run per further draft, fed the head's own hidden
output (their KV is dropped afterwards: only verified positions get real features). A draft
graph that takes its attention's lengths (every fused one: ``exporter.eagle_graph``; older
ones get them when opened) keeps that KV in one buffer written in place through IO binding
(``eagle_kv.InPlaceHead``), as the target's shared layout does; the exported TorchScript graph
(other providers, head sizes the fused attention refuses) is fed its past and returns the
present (``past_key`` / ``past_value`` here). Greedy
drafts carry no probabilities, so every verifier (greedy, rejection sampling) stays lossless.

``tree_paths``: a dynamic token tree instead of a chain (``--tree-width W`` on an artifact
exported with ``--tree-mask``): the same first run, then a beam of the W most likely paths
by the head's cumulative probability, one batched run per depth (each path on its own copy
of the draft KV), every path the head gives at least ``MIN_PROB`` kept. The tree loop
verifies them in one target run and ``observe_path`` keeps the accepted path's features.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from pathlib import Path
from typing import Any

import numpy as np

from specport.artifact.manifest import Manifest
from specport.core.contract import EAGLE_FEATURES, EAGLE_LENGTH_INPUTS
from specport.core.errors import InputError
from specport.runtime.speculative.base import Drafts, ProposerBase
from specport.runtime.speculative.eagle_kv import InPlaceHead, takes_lengths
from specport.runtime.speculative.token_tree import beam_step

logger = logging.getLogger(__name__)

# A tree path the head gives a lower cumulative probability is left out: every scored node
# costs target time. The MTP trees' cut (runtime.speculative.mtp_tree.MIN_PROB, measured
# there), not tuned for EAGLE heads, which are over-confident on unseen chat (see the guide)
MIN_PROB = 0.05


def eagle_info(manifest: Manifest) -> dict[str, Any]:
    """The manifest's ``eagle`` entry, or an InputError saying how to get one."""
    info = manifest.extra.get("eagle")
    if not info or not info.get("graph"):
        raise InputError(
            "this artifact has no EAGLE draft head (manifest 'eagle' is missing). Train one with "
            "`specport train-draft ARTIFACT --out DRAFTED` and run DRAFTED, or use "
            "--speculative ngram|suffix."
        )
    return info  # type: ignore[no-any-return]


class EagleProposer(ProposerBase):
    """Drafts a chain with the artifact's EAGLE head (batch 1 per proposer)."""

    name = "eagle"
    adaptive_default = True
    needs_outputs = True  # the features come out of the target's own run

    def __init__(
        self, session: Any, manifest: Manifest, draft_ids: np.ndarray | None = None
    ) -> None:
        """``draft_ids``: the target id of each draft-vocabulary row (trees rank the head's
        logits over them; a chain reads the graph's own ``draft_token``)."""
        info = eagle_info(manifest)
        cfg = info["config"]
        self.session = session
        self.draft_ids = draft_ids
        self.features_name = str(info.get("features") or EAGLE_FEATURES)
        self.hidden = int(cfg["hidden"])
        self.feat_dim = int(cfg["feature_layers"]) * self.hidden
        self.kv_shape = (1, int(cfg["kv_heads"]), 0, int(cfg["head_dim"]))
        self.head_ratio = float(cfg["draft_vocab"]) / max(int(cfg["vocab"]), 1)
        self._zero_feat = np.zeros((1, 1, self.feat_dim), np.float32)
        self._zero_hidden = np.zeros((1, 1, self.hidden), np.float32)
        self._stage = np.zeros((8, self.feat_dim), np.float32)  # [rows, 3H] pending features
        self.lengths_fed = takes_lengths(session)  # the graph takes its attention's lengths
        self.in_place: InPlaceHead | None = None  # the head's KV written in place (chains)
        if self.lengths_fed:
            self.in_place = InPlaceHead(
                session,
                self.hidden,
                self.feat_dim,
                int(cfg["kv_heads"]),
                int(cfg["head_dim"]),
                int(cfg["draft_vocab"]),
            )
        self.reset()

    def reset(self) -> None:
        self.past_key = np.zeros(self.kv_shape, np.float32)  # the concat runs' past
        self.past_value = np.zeros(self.kv_shape, np.float32)
        if self.in_place is not None:
            self.in_place.reset()
        self.seen = 0  # context positions whose real features are in past (or skipped)
        self.staged = 0  # pending rows: self._stage[:staged], not in the head's KV yet

    def start(
        self, sampling: Any = None, stream: int | None = None, budget: int | None = None
    ) -> None:
        self.reset()

    def observe_prefill(self, outputs: dict[str, np.ndarray]) -> None:
        """A prefill run's outputs (all but the last prompt token), for a loop that shows them:
        the features of its last position, so the first step drafts too. The loops do not
        (their first step feeds the last prompt token and drafts nothing), and the head is
        trained on the KV they give it, from the last prompt token on (``eagle_train``)."""
        self.reset()
        feats = outputs.get(self.features_name)
        if feats is not None:
            self._stage_rows(feats[0, -1:])

    def observe(self, outputs: dict[str, np.ndarray], result: Any) -> None:
        """Keep the features of the fed positions that were accepted (last token + drafts)."""
        feats = outputs.get(self.features_name)
        if feats is not None:  # the fed prefix: a slice, copied once into the staging rows
            self._stage_rows(feats[0, : int(result.accepted[0]) + 1])

    def observe_path(self, outputs: dict[str, np.ndarray], path: list[int]) -> None:
        """Keep the features of rows ``path`` of the run (a token tree's accepted nodes from
        its root, or a chain's fed prefix): the positions the context now holds."""
        feats = outputs.get(self.features_name)
        if feats is None:
            return  # a loop that shows no outputs: later drafts attend to fewer positions
        self._stage_rows(feats[0], path)  # copied: the run's buffers are reused

    def _stage_rows(self, rows: np.ndarray, index: list[int] | None = None) -> None:
        """Append ``rows`` [k, 3H] (or its rows ``index``) to the pending rows, one copy; the
        staging array doubles when full (the in-place head binds it again)."""
        k = rows.shape[0] if index is None else len(index)
        end = self.staged + k
        if end > self._stage.shape[0]:
            grown = np.zeros((max(end, 2 * self._stage.shape[0]), self.feat_dim), np.float32)
            grown[: self.staged] = self._stage[: self.staged]
            self._stage = grown
        out = self._stage[self.staged : end]
        if index is None:
            np.copyto(out, rows, casting="unsafe")
        else:
            np.take(rows, index, axis=0, out=out)
        self.staged = end

    def pending_rows(self) -> np.ndarray:
        """The pending features [n, 3H] (a view of the staging rows)."""
        return self._stage[: self.staged]

    def draft_cost(self, target: Any) -> float:
        # one position of one layer plus a draft-vocabulary head, against the target's step
        layers = int(getattr(target, "num_layers", 30) or 30)
        return 1.5 / layers + self.head_ratio / 8

    def propose(self, context: list[list[int]], num_draft: int) -> Drafts:
        if len(context) != 1:
            raise InputError(f"the EAGLE proposer drafts one row, got {len(context)}")
        if num_draft <= 0 or not self.staged:
            return Drafts.one([])
        if self.in_place is not None:
            ids, n = self._take_pending(context[0])
            drafts = [self.in_place.catch_up(ids, self._stage, n, num_draft)[0]]
            while len(drafts) < num_draft:
                drafts.append(self.in_place.draft(drafts[-1], len(drafts) - 1))
            return Drafts.one(drafts)
        token, _, hidden, key, value = self._advance(context[0])
        drafts = [int(token[0])]
        while len(drafts) < num_draft:
            token, _, hidden, key, value = self._run(
                np.asarray([[drafts[-1]]], dtype=np.int64), self._zero_feat, hidden, key, value
            )
            drafts.append(int(token[0]))
        return Drafts.one(drafts)

    def tree_paths(
        self, context: list[int], depth: int, width: int, min_prob: float = MIN_PROB
    ) -> list[list[int]]:
        """Up to ``width`` paths per depth, best first by the head's cumulative probability
        (a path's prefix is always listed before it): a beam of width ``width``, one batched
        head run per depth; paths below ``min_prob`` are dropped, so the tree shrinks to
        nothing (a plain step) where the head is unsure."""
        if depth <= 0 or not self.staged:
            return []
        if self.draft_ids is None:
            raise InputError("EAGLE token trees need the head's draft vocabulary (draft_ids)")
        _, logits, hidden, key, value = self._advance(context)
        min_logp = float(np.log(min_prob)) if min_prob > 0 else -np.inf
        paths: list[list[int]] = [[]]
        scores = np.zeros(1)
        out: list[tuple[float, list[int]]] = []
        for d in range(depth):
            if d:
                ids = np.asarray([[p[-1]] for p in paths], dtype=np.int64)
                feats = np.zeros((len(paths), 1, self.feat_dim), np.float32)
                _, logits, hidden, key, value = self._run(ids, feats, hidden, key, value)
            logp = _log_softmax(logits)  # [n, Vd]
            k = min(width, logp.shape[1])
            top = np.argpartition(-logp, k - 1, axis=1)[:, :k]  # [n, k] each path's best k
            top_logp = np.take_along_axis(logp, top, 1)
            step = beam_step(paths, scores, self.draft_ids[top], top_logp, width, min_logp)
            if step is None:
                break
            rows, paths, scores = step
            hidden, key, value = hidden[rows], key[rows], value[rows]
            out.extend(zip(scores.tolist(), paths))
        out.sort(key=lambda sp: -sp[0])  # a prefix scores at least its extensions: first
        return [p for _, p in out]

    def _take_pending(self, ctx: list[int]) -> tuple[list[int], int]:
        """The pending real positions, taken: (the token each pairs with [n], n); their
        features are the staging rows [0, n) until the next ``observe``."""
        # rows for positions end-n+1 .. len(ctx)-2
        n = min(self.staged, len(ctx) - 1)
        if n < self.staged:  # more rows than context (a prefill shown twice): the last n
            self._stage[:n] = self._stage[self.staged - n : self.staged].copy()
        first = len(ctx) - 1 - n  # context position of the first pending row
        self.staged = 0
        self.seen = first + n
        return ctx[first + 1 : first + 1 + n], n

    def _advance(self, ctx: list[int]) -> tuple[np.ndarray, ...]:
        """Run the head over the pending real positions (their KV becomes the head's past):
        ``_run``'s outputs for the first draft, from which later drafts continue (the past
        and present as arrays: copies of the in-place buffer's real positions there)."""
        ids, n = self._take_pending(ctx)
        if self.in_place is not None:
            _, logits = self.in_place.catch_up(ids, self._stage, n, 0)
            head = self.in_place
            token = head.token.copy()
            return token, logits.copy(), head.last_hidden(), head.key.copy(), head.value.copy()
        out = self._run(
            np.asarray([ids], dtype=np.int64),
            self._stage[None, :n].copy(),
            np.zeros((1, len(ids), self.hidden), np.float32),
            self.past_key,
            self.past_value,
        )
        self.past_key, self.past_value = out[3], out[4]
        return out

    def _run(
        self,
        ids: np.ndarray,  # [n, S] int64
        feats: np.ndarray,  # [n, S, 3H]
        hidden: np.ndarray,  # [n, S, H]
        key: np.ndarray,  # [n, Hkv, P, Dh]
        value: np.ndarray,
    ) -> tuple[np.ndarray, ...]:
        """(greedy draft [n] as target ids, draft-vocabulary logits [n, Vd], the hidden output
        of the last position [n, 1, H], present key, present value)."""
        feed = {
            "input_ids": ids,
            "features": feats,
            "hidden_in": hidden,
            "past_key": key,
            "past_value": value,
        }
        if self.lengths_fed:  # concat: every row's KV ends at P + S
            end = key.shape[2] + ids.shape[1]
            feed[EAGLE_LENGTH_INPUTS[0]] = np.full(ids.shape[0], end - 1, np.int32)
            feed[EAGLE_LENGTH_INPUTS[1]] = np.array(end, np.int32)
        token, logits, out_hidden, present_key, present_value = self.session.run(None, feed)
        return token, logits, out_hidden[:, -1:], present_key, present_value


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


_SESSIONS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def make_eagle_proposer(model: Any, tree: bool = False) -> EagleProposer:
    """The proposer for a loaded model whose artifact carries an EAGLE head: the draft graph
    opens on the model's provider, one thread (a one-layer graph gains nothing from more),
    once per model (every request's proposer shares it; a session holds no request state).
    ``tree``: it also drafts token trees (``tree_paths``; reads the draft vocabulary)."""
    info = eagle_info(model.manifest)
    try:
        opened = _SESSIONS.get(model)
    except TypeError:  # not weakly referenceable
        opened = None
    if opened is None:
        opened = {"session": _open_draft(model, info)}
        with contextlib.suppress(TypeError):
            _SESSIONS[model] = opened
    if tree and "draft_ids" not in opened:
        opened["draft_ids"] = draft_vocabulary(model.path / draft_graph(model, info))
    return EagleProposer(opened["session"], model.manifest, opened.get("draft_ids"))


def draft_vocabulary(graph: Path) -> np.ndarray:
    """The target id of each row of the head's draft vocabulary: the draft graph's
    ``draft_ids`` constant (``exporter.eagle_head``), read once per loaded model."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(graph), load_external_data=False)
    for init in model.graph.initializer:
        if init.name.endswith("draft_ids"):
            return numpy_helper.to_array(init).astype(np.int64)
    raise InputError(
        f"{graph}: the draft graph has no draft_ids constant, which EAGLE token trees need; "
        "rerun `specport train-draft`, or use the chain (tree width 1)."
    )


def _open_draft(model: Any, info: dict[str, Any]) -> Any:
    from specport.runtime.session import SessionConfig, make_session

    outputs = {o.name for o in model.session.get_outputs()}
    if str(info.get("features") or EAGLE_FEATURES) not in outputs:
        raise InputError(
            f"{model.path}: the target graph has no {EAGLE_FEATURES!r} output; the artifact is "
            "incomplete (rerun `specport train-draft`)."
        )
    base = getattr(model, "session_config", None) or SessionConfig(provider=model.provider)
    config = SessionConfig(
        provider=base.provider,
        intra_op_threads=1,
        allow_spinning=base.allow_spinning,
        huge_pages=False,
        provider_options=dict(base.provider_options),
    )
    graph = model.path / draft_graph(model, info)
    session, _ = make_session(graph, config)
    if not takes_lengths(session) and _fused(model, info, graph):
        # a fused graph written before its attention took its lengths: given them here, so
        # the head's KV stays in place (``eagle_kv``); one more parse of a small graph
        import onnx

        from specport.exporter.eagle_lengths import lengths_as_inputs

        proto = onnx.load(str(graph))
        if lengths_as_inputs(proto):
            session, _ = make_session(proto.SerializeToString(), config)
    return session


def _fused(model: Any, info: dict[str, Any], graph: Path) -> bool:
    """Is ``graph`` the head on onnxruntime's fused attention (the CPU int8 graph, when the
    manifest says it was written on it)?"""
    int8 = info.get("int8_graph")
    return (
        bool(int8)
        and graph.name == Path(str(int8)).name
        and (info.get("int8_attention") == "GroupQueryAttention")
    )


def draft_graph(model: Any, info: dict[str, Any]) -> str:
    """The draft graph to run: the int8 one on the CPU provider when the artifact has it (a
    draft run's time there is the bytes of its weights: see ``exporter.eagle_artifact.
    quantize_draft``), else the float one."""
    int8 = info.get("int8_graph")
    cpu = str(getattr(model, "provider", "cpu") or "cpu").lower() in ("cpu", "cpuexecutionprovider")
    if int8 and cpu and (Path(model.path) / int8).is_file():
        return str(int8)
    return str(info["graph"])
