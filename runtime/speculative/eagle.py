"""EAGLE proposer: a small draft head reads the target's own hidden states and drafts a chain.

The artifact's target graph outputs ``eagle_features`` [B, S, 3H] (three layers' hidden
states at every fed position) in the same run that scores the drafts; ``eagle_draft.onnx`` is
the head, with its own one-layer KV cache (``exporter.eagle_artifact``). The proposer keeps:

* ``past``: the head's keys and values for every position it has seen real features of;
* ``pending``: features the loop showed it (``observe``) whose following token was not known
  yet - it is, at the next ``propose``: feature row i belongs to context position i and pairs
  with context token i+1, so the proposer needs no positions from the loop.

``propose``: one head run over the pending positions (their KV becomes real), which drafts
the first token; then one single-position run per further draft, fed the head's own hidden
output (their KV is dropped afterwards: only verified positions get real features). Greedy
drafts carry no probabilities, so every verifier (greedy, rejection sampling) stays lossless.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from typing import Any

import numpy as np

from specport.artifact import Manifest
from specport.errors import InputError
from specport.runtime.speculative.base import Drafts, ProposerBase

logger = logging.getLogger(__name__)

FEATURES = "eagle_features"


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

    def __init__(self, session: Any, manifest: Manifest) -> None:
        info = eagle_info(manifest)
        cfg = info["config"]
        self.session = session
        self.features_name = str(info.get("features") or FEATURES)
        self.hidden = int(cfg["hidden"])
        self.feat_dim = int(cfg["feature_layers"]) * self.hidden
        self.kv_shape = (1, int(cfg["kv_heads"]), 0, int(cfg["head_dim"]))
        self.head_ratio = float(cfg["draft_vocab"]) / max(int(cfg["vocab"]), 1)
        self._zero_feat = np.zeros((1, 1, self.feat_dim), np.float32)
        self._zero_hidden = np.zeros((1, 1, self.hidden), np.float32)
        self.reset()

    def reset(self) -> None:
        self.past_key = np.zeros(self.kv_shape, np.float32)
        self.past_value = np.zeros(self.kv_shape, np.float32)
        self.seen = 0  # context positions whose real features are in past (or skipped)
        self.pending: list[np.ndarray] = []  # [n, 3H] blocks not in past yet

    def start(self, sampling: Any = None, stream: int | None = None) -> None:
        self.reset()

    def observe_prefill(self, outputs: dict[str, np.ndarray]) -> None:
        """A prefill run's outputs (all but the last prompt token), for a loop that shows them:
        the features of its last position, so the first step drafts too. The loops do not
        (their first step feeds the last prompt token and drafts nothing), and the head is
        trained on the KV they give it, from the last prompt token on (``eagle_train``)."""
        self.reset()
        feats = outputs.get(self.features_name)
        if feats is not None:
            self.pending.append(np.array(feats[0, -1:], dtype=np.float32))

    def observe(self, outputs: dict[str, np.ndarray], result: Any) -> None:
        """Keep the features of the fed positions that were accepted (last token + drafts)."""
        feats = outputs.get(self.features_name)
        if feats is None:
            return  # a loop that shows no outputs: later drafts attend to fewer positions
        kept = int(np.asarray(result.accepted).reshape(-1)[0]) + 1
        self.pending.append(np.array(feats[0, :kept], dtype=np.float32))

    def draft_cost(self, target: Any) -> float:
        # one position of one layer plus a draft-vocabulary head, against the target's step
        layers = int(getattr(target, "num_layers", 30) or 30)
        return 1.5 / layers + self.head_ratio / 8

    def propose(self, context: list[list[int]], num_draft: int) -> Drafts:
        if len(context) != 1:
            raise InputError(f"the EAGLE proposer drafts one row, got {len(context)}")
        ctx = context[0]
        if num_draft <= 0 or not self.pending:
            return Drafts.one([])
        feats = np.concatenate(self.pending, 0)  # rows for positions end-n+1 .. len(ctx)-2
        n = min(len(feats), len(ctx) - 1)
        feats = feats[len(feats) - n :]
        first = len(ctx) - 1 - n  # context position of the first pending row
        self.pending = []
        self.seen = first + n
        ids = np.asarray([ctx[first + 1 : first + 1 + n]], dtype=np.int64)
        out = self._run(
            ids,
            feats[None],
            np.zeros((1, n, self.hidden), np.float32),
            self.past_key,
            self.past_value,
        )
        token, hidden, self.past_key, self.past_value = out
        drafts = [token]
        key, value = self.past_key, self.past_value
        while len(drafts) < num_draft:
            token, hidden, key, value = self._run(
                np.asarray([[token]], dtype=np.int64), self._zero_feat, hidden, key, value
            )
            drafts.append(token)
        return Drafts.one(drafts)

    def _run(
        self,
        ids: np.ndarray,  # [1, S] int64
        feats: np.ndarray,  # [1, S, 3H]
        hidden: np.ndarray,  # [1, S, H]
        key: np.ndarray,  # [1, Hkv, P, Dh]
        value: np.ndarray,
    ) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
        token, _, out_hidden, present_key, present_value = self.session.run(
            None,
            {
                "input_ids": ids,
                "features": feats,
                "hidden_in": hidden,
                "past_key": key,
                "past_value": value,
            },
        )
        return int(token[0]), out_hidden[:, -1:], present_key, present_value


_SESSIONS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def make_eagle_proposer(model: Any) -> EagleProposer:
    """The proposer for a loaded model whose artifact carries an EAGLE head: the draft graph
    opens on the model's provider, one thread (a one-layer graph gains nothing from more),
    once per model (every request's proposer shares it; a session holds no request state)."""
    info = eagle_info(model.manifest)
    try:
        session = _SESSIONS.get(model)
    except TypeError:  # not weakly referenceable
        session = None
    if session is None:
        session = _open_draft(model, info)
        with contextlib.suppress(TypeError):
            _SESSIONS[model] = session
    return EagleProposer(session, model.manifest)


def _open_draft(model: Any, info: dict[str, Any]) -> Any:
    from specport.runtime.session import SessionConfig, make_session

    outputs = {o.name for o in model.session.get_outputs()}
    if str(info.get("features") or FEATURES) not in outputs:
        raise InputError(
            f"{model.path}: the target graph has no {FEATURES!r} output; the artifact is "
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
    session, _ = make_session(model.path / info["graph"], config)
    return session
