"""The graphs an MTP artifact ships beside its main graph, so the runtime only opens graphs.

onnxruntime runs every node of a graph whatever outputs are fetched, so decoding without MTP
(plain, n-gram, draft model) on the MTP graph would pay for the heads at every step
(SmolLM2-135M: 1.47x slower per token), and MTP token trees verify on a graph without the chain
branch that returns the LM head's input. These graphs are written when the artifact is made
(`train-mtp`, `quantize`) or upgraded (`specport upgrade`), not derived when it loads:

    plain        the main graph without the MTP branch (`strip_mtp_branch`)
    tree_verify  the same with the hidden state as an output (`expose_lm_head_input`); only for
                 artifacts with a `tree_mask` input (the only ones MTP trees run on)

Both are weightless: their initializers stay in the main graph's external weights file. The
manifest records them as ``mtp["graphs"]`` (kind -> file).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import onnx_ir as ir

from specport.core.contract import TREE_MASK
from specport.passes.mtp import expose_lm_head_input, strip_mtp_branch

logger = logging.getLogger(__name__)

GRAPHS_KEY = "graphs"
PLAIN = "plain"
TREE_VERIFY = "tree_verify"
FILES = {PLAIN: "model.plain.onnx", TREE_VERIFY: "model.tree_verify.onnx"}


def needs_mtp_graphs(manifest: Any) -> bool:
    """Whether ``manifest`` describes an MTP artifact made before its graphs were stored."""
    mtp = manifest.mtp or {}
    return bool(mtp.get("heads")) and not mtp.get(GRAPHS_KEY)


def write_mtp_graphs(directory: Path, manifest: Any) -> dict[str, str]:
    """Write the derived graphs of the MTP artifact in ``directory`` (its main graph and
    weights already there) and record them in ``manifest.mtp``; returns kind -> file name."""
    directory = Path(directory)
    model = ir.load(directory / manifest.model_file)
    removed = strip_mtp_branch(model)
    graphs = {PLAIN: FILES[PLAIN]}
    ir.save(model, directory / FILES[PLAIN])  # external weights keep their location
    if any(v.name == TREE_MASK for v in model.graph.inputs):
        expose_lm_head_input(model)
        ir.save(model, directory / FILES[TREE_VERIFY])
        graphs[TREE_VERIFY] = FILES[TREE_VERIFY]
    manifest.mtp = {**manifest.mtp, GRAPHS_KEY: graphs}
    logger.info("MTP graphs written (branch of %d nodes left out): %s", removed, graphs)
    return graphs
