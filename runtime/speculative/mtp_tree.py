"""MTP top-k candidates for a token tree: the heads' best continuations, verified in one run.

The chain MTP proposer carries K greedy drafts that the graph's own branch computed. A tree
asks the heads for more, so they run on their own, in onnxruntime, from the artifact's
standalone heads graph (``mtp_heads.onnx``, written by ``train-mtp`` on a ``--tree-mask``
export; ``exporter.mtp_heads_graph``):

1. the verify run must return the base model's hidden state (the LM head's input) of every
   tree node. At the first MTP tree generation the artifact's graph is derived once: the
   in-graph chain branch is stripped (onnxruntime runs every node, and the branch would
   draft a chain nobody reads) and the hidden state becomes an output (``passes.mtp``);
2. after a run accepts node a and emits token x after it, head 1 on (hidden(a), x) scores
   the next token: its top-W become the root's children; head d+1 runs on the W best
   depth-d paths by cumulative log-probability (their chained hidden states and last
   tokens, one batched run per depth) and the W best of their W x W extensions are kept:
   a beam of width W whose paths form the tree (at most 1 + depth x W nodes, best first,
   so the best candidates are tried first when sampling). Paths below ``MIN_PROB`` are
   dropped, so the tree shrinks when the heads are unsure (down to the root alone).

Verification is the tree loop's: greedy output equals plain greedy, sampling is lossless.
With width 1 the beam is the heads' greedy chain (the chain MTP proposer's drafts), cut
where it becomes unlikely.
"""

from __future__ import annotations

import logging
import weakref
from pathlib import Path
from typing import Any

import numpy as np

from specport.core.errors import InputError
from specport.runtime.speculative.loop import check_num_draft
from specport.runtime.speculative.mtp import mtp_info
from specport.runtime.speculative.token_tree import beam_step
from specport.runtime.speculative.tree_generator import (
    TreeSpeculativeGenerator,
    check_tree_width,
    has_tree_mask,
)

logger = logging.getLogger(__name__)

METHOD = "mtp-tree"
# A path the heads give less than this probability is left out of the tree: scoring a node is
# not free (SmolLM2-135M, 2 threads: ~4 ms per extra node on a ~50 ms verify run), and the
# heads' unlikely paths are rarely accepted. Measured there (3 heads, width 3, 5 chat prompts):
# all paths 8.8 nodes and 1.38 tokens per step, >= 0.05 3.1 nodes and 1.31 tokens per step.
MIN_PROB = 0.05
# loaded model -> (verify session with the hidden-state output, heads session)
_SESSIONS: weakref.WeakKeyDictionary[Any, tuple[Any, Any]] = weakref.WeakKeyDictionary()


def heads_graph_record(manifest: Any) -> dict[str, Any]:
    """The manifest's heads-graph record, or an InputError saying how to get one."""
    record = mtp_info(manifest).get("heads_graph")
    if not record:
        raise InputError(
            "this MTP artifact has no heads graph (mtp_heads.onnx), which MTP token trees "
            "need: its heads were trained before trees took MTP candidates. Re-run "
            "`specport train-mtp BASE --out DIR ...` on the base exported with `--tree-mask`, "
            "or use chain MTP (tree width 1)."
        )
    return dict(record)


class MTPTreeCandidates:
    """A tree loop's candidate source and run observer over the heads graph (one generation)."""

    def __init__(
        self, heads_session: Any, record: dict[str, Any], num_heads: int, min_prob: float = 0.0
    ) -> None:
        """``min_prob``: drop paths the heads give a lower probability (product over depths)."""
        self.session = heads_session
        self.inputs = record["inputs"]
        self.outputs = record["outputs"]
        self.width = int(record["width"])
        self.num_heads = int(num_heads)
        self.min_logp = float(np.log(min_prob)) if min_prob > 0 else -np.inf
        self.seed: np.ndarray | None = None  # [H] hidden state of the last accepted node
        self.head_seconds = 0.0

    def observe(self, outputs: dict[str, np.ndarray], path: list[int]) -> None:
        """Keep the hidden state the verify run computed at the last accepted node."""
        from specport.passes.mtp import HIDDEN_OUTPUT

        hidden = outputs[HIDDEN_OUTPUT]  # [1, S, H]
        self.seed = np.array(hidden[0, path[-1]], dtype=np.float32)  # a copy: buffers are reused

    def __call__(self, context: list[int], depth: int, width: int) -> list[list[int]]:
        """The beam's paths, depth by depth, best first (each path's prefix comes before it)."""
        if self.seed is None or depth < 1:
            return []
        width = min(int(width), self.width)
        hidden = self.seed[None]  # [n, H]
        tokens = np.asarray([context[-1]], dtype=np.int64)  # [n]
        paths: list[list[int]] = [[]]
        scores = np.zeros(1, dtype=np.float64)
        out: list[list[int]] = []
        for d in range(min(depth, self.num_heads)):
            nxt, ids, logp = self._run(d, hidden, tokens)  # [n, H], [n, W], [n, W]
            step = beam_step(paths, scores, ids[:, :width], logp[:, :width], width, self.min_logp)
            if step is None:
                break
            rows, paths, scores = step
            hidden, tokens = nxt[rows], np.asarray([p[-1] for p in paths], dtype=np.int64)
            out.extend(paths)
        return out

    def _run(self, head: int, hidden: np.ndarray, tokens: np.ndarray) -> list[np.ndarray]:
        import time

        feeds = {
            self.inputs["hidden"]: np.ascontiguousarray(hidden, dtype=np.float32),  # [n, H]
            self.inputs["tokens"]: np.ascontiguousarray(tokens, dtype=np.int64),  # [n]
            self.inputs["head"]: np.array([head], dtype=np.int64),  # [1]
        }
        names = [self.outputs[k] for k in ("hidden", "ids", "logp")]
        t0 = time.perf_counter()
        result = self.session.run(names, feeds)
        self.head_seconds += time.perf_counter() - t0
        return list(result)


def _verify_session(model: Any) -> Any:
    """A session on the artifact's stored tree-verify graph: the main graph without the chain
    branch, returning the hidden state (`passes/mtp_graphs.py`, written when the artifact was
    made). Same options and providers as the model's own session."""
    import onnxruntime as ort

    from specport.runtime.session import mtp_graph_file

    path = Path(model.path) / mtp_graph_file(model.path, model.manifest, "tree_verify")
    return ort.InferenceSession(
        str(path),
        sess_options=model.session.get_session_options(),
        providers=model.session.get_providers(),
    )


def mtp_tree_sessions(model: Any) -> tuple[Any, Any]:
    """(verify session, heads session) for MTP trees on ``model``, made once per loaded model."""
    cached = _SESSIONS.get(model)
    if cached is not None:
        return cached
    if not has_tree_mask(model.session):
        raise InputError(
            "MTP token trees need an artifact with a 'tree_mask' input: export the base with "
            "`specport export MODEL --out DIR --tree-mask`, train the heads on it with "
            "`specport train-mtp`, or use chain MTP (tree width 1)."
        )
    import onnxruntime as ort

    record = heads_graph_record(model.manifest)
    heads = ort.InferenceSession(
        str(Path(model.path) / record["file"]),
        sess_options=model.session.get_session_options(),
        providers=model.session.get_providers(),
    )
    sessions = (_verify_session(model), heads)
    _SESSIONS[model] = sessions
    return sessions


def mtp_tree_generator(
    model: Any, num_draft: int, tree_width: int, min_prob: float = MIN_PROB
) -> TreeSpeculativeGenerator:
    """A tree generator whose candidates come from ``model``'s MTP heads (one generation)."""
    info = mtp_info(model.manifest)
    num_heads = int(info["heads"])
    if check_num_draft(num_draft) > num_heads:
        raise InputError(
            f"a token tree {num_draft} deep needs {num_draft} MTP heads; the artifact has "
            f"{num_heads}."
        )
    check_tree_width(tree_width)
    verify, heads = mtp_tree_sessions(model)
    source = MTPTreeCandidates(heads, heads_graph_record(model.manifest), num_heads, min_prob)
    return TreeSpeculativeGenerator(
        verify,
        model.manifest,
        num_draft,
        tree_width,
        candidates=source,
        observer=source.observe,
        method=METHOD,
    )
