"""Writing an MTP artifact: the source artifact copied with the MTP branch spliced in.

Kept apart from training (`mtp_train`) because it is the one step both paths share - heads
trained by self-distillation and a DeepSeek-V3 checkpoint's own MTP layers - and tests build
MTP artifacts with it directly. `mtp_train` re-exports `write_mtp_artifact`.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from specport.artifact import manifest as art
from specport.artifact.files import write_artifact_manifest
from specport.core.contract import TREE_MASK
from specport.core.errors import InputError
from specport.exporter.mtp_heads import MTPHeads, export_branch
from specport.exporter.mtp_heads_graph import save_heads_graph
from specport.exporter.mtp_weights import save_heads
from specport.passes.mtp import BRANCH_OUTPUTS, InsertMTPBranchPass
from specport.passes.mtp_graphs import write_mtp_graphs


def write_mtp_artifact(
    artifact: Path, heads: MTPHeads, out: Path, report: dict[str, Any]
) -> art.Manifest:
    """Copy ``artifact`` to ``out`` with the MTP branch spliced into model.onnx.

    A ``--tree-mask`` artifact also gets the standalone heads graph (``mtp_heads.onnx``), which
    token-tree decoding asks for each depth's top-W candidates."""
    import onnx_ir as ir

    from specport.exporter.onnx_graph import io_signature

    manifest = art.read_manifest(artifact)
    model = ir.load(str(Path(artifact) / manifest.model_file))
    tree = any(v.name == TREE_MASK for v in model.graph.inputs)
    result = InsertMTPBranchPass(export_branch(heads, manifest.vocab_size))(model)
    if not result.modified:
        raise InputError(f"could not add the MTP branch: {result.report.get('skipped')}")
    with art.atomic_artifact_dir(Path(out)) as tmp:
        for f in manifest.files:
            if f not in (manifest.model_file, art.DATA_NAME):
                (tmp / f).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(Path(artifact) / f, tmp / f)
        ir.save(model, tmp / art.MODEL_NAME, external_data=art.DATA_NAME)
        save_heads(heads, tmp)
        heads_graph = save_heads_graph(heads, tmp) if tree else None
        details = {k: v for k, v in result.report.items() if not k.startswith("ops_")}
        manifest.passes = [*manifest.passes, details]
        manifest.model_file = art.MODEL_NAME
        manifest.io = io_signature(tmp / art.MODEL_NAME)
        manifest.mtp = {
            "heads": heads.num_heads,
            "outputs": dict(zip(("accepted", "bonus", "drafts"), BRANCH_OUTPUTS)),
            "inputs": {
                "hidden": details["hidden_from"],
                "logits": "logits",
                "input_ids": "input_ids",
            },
            "weights": "mtp_heads.safetensors",
            "attention": "self-position (no MTP KV cache)",
            "training": report,
        }
        if heads_graph is not None:
            manifest.mtp["heads_graph"] = heads_graph
        write_mtp_graphs(tmp, manifest)  # the graphs without the branch: the runtime opens them
        write_artifact_manifest(tmp, manifest)
    return manifest
