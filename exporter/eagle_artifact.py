"""Writing an EAGLE artifact: the target graph with its feature output, plus the draft graph.

The artifact is a copy of the input with

* ``model.onnx`` re-saved with the ``eagle_features`` output (``passes.eagle_features``; the
  weights file is copied as it is, the logits and presents are the same values as before);
* ``eagle_draft.onnx``: the head (``eagle_head.EagleHead``) as its own small graph with its
  own KV cache in the concat form (past in, present out; one layer, [B, Hkv, P, Dh]): the
  proposer keeps the keys of every real position and drops the draft positions' keys after
  each verify, so a draft costs one position of one layer plus a draft-vocabulary LM head;
* manifest key ``eagle``: the graph, its inputs and outputs, the feature layers, the head's
  shape, the draft vocabulary size and the training report.

The KV is kept (rather than a short window recomputed per draft) because one position with
KV costs about 1/30 of a target layer's position, while a 16-position window would cost 16x
that per draft and forget the prompt, which rewriting prompts copy from.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import onnx_ir as ir
import torch
from torch import nn

from specport.artifact import manifest as art
from specport.core.contract import EAGLE_FEATURES
from specport.core.errors import InputError
from specport.exporter.eagle_head import INPUTS, OUTPUTS, EagleHead
from specport.passes.eagle_features import ExposeEagleFeaturesPass

logger = logging.getLogger(__name__)

DRAFT_FILE = "eagle_draft.onnx"
# the same head with int8 weights, what the CPU provider runs (``quantize_draft``)
INT8_DRAFT_FILE = "eagle_draft.int8.onnx"
MANIFEST_KEY = "eagle"


def has_features(model: ir.Model) -> bool:
    return any(v.name == EAGLE_FEATURES for v in model.graph.outputs)


def featured_graph(artifact: Path, manifest: art.Manifest) -> tuple[ir.Model, dict[str, Any]]:
    """The artifact's graph with the ``eagle_features`` output (as it is if it has one)."""
    model = ir.load(str(Path(artifact) / manifest.model_file))
    if has_features(model):
        return model, {}
    result = ExposeEagleFeaturesPass(manifest.num_layers)(model)
    if not result.modified:
        raise InputError(f"could not add the EAGLE features: {result.report.get('skipped')}")
    return model, {k: v for k, v in result.report.items() if not k.startswith("ops_")}


def copy_with_features(
    artifact: Path, out: Path, manifest: art.Manifest
) -> tuple[art.Manifest, dict[str, Any]]:
    """``artifact``'s files in ``out`` with ``model.onnx`` carrying the features output; returns
    the manifest to complete (not written yet) and the pass report."""
    from specport.exporter.onnx_graph import io_signature

    model, report = featured_graph(artifact, manifest)
    out.mkdir(parents=True, exist_ok=True)
    for f in manifest.files:
        if f != manifest.model_file and f != DRAFT_FILE:
            (out / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(Path(artifact) / f, out / f)
    ir.save(model, out / manifest.model_file)  # external weights keep their (copied) file
    manifest = art.read_manifest(artifact)
    if report:
        manifest.passes = [*manifest.passes, report]
    manifest.io = io_signature(out / manifest.model_file)
    return manifest, report


class _Exported(nn.Module):
    """The head as exported: the embedding table stored in float16 (it is only an input
    signal to the head; half the bytes of the largest tensor in the draft graph)."""

    def __init__(self, head: EagleHead) -> None:
        super().__init__()
        self.head = head
        self.head.embed = head.embed.to(torch.float16)

    def forward(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        hidden_in: torch.Tensor,
        past_key: torch.Tensor,
        past_value: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        return self.head(input_ids, features, hidden_in, past_key, past_value)  # type: ignore[no-any-return]


def export_draft(head: EagleHead, path: Path) -> None:
    """Write the head to ``path`` as an ONNX graph with inputs INPUTS and outputs OUTPUTS.

    The TorchScript exporter, not dynamo: for one layer it takes about a second against
    dynamo's twenty, and the graph is small enough that its fusions do not matter."""
    import warnings

    from specport.core.errors import ExportError

    cfg = head.cfg
    saved = head.embed
    module = _Exported(head).eval()
    b, s, p = 1, 3, 5
    g = torch.Generator().manual_seed(0)
    args = (
        torch.randint(0, cfg.vocab, (b, s), generator=g),
        torch.randn(b, s, cfg.feature_layers * cfg.hidden, generator=g),
        torch.zeros(b, s, cfg.hidden),
        torch.randn(b, cfg.kv_heads, p, cfg.head_dim, generator=g),
        torch.randn(b, cfg.kv_heads, p, cfg.head_dim, generator=g),
    )
    dims = {0: "batch", 1: "sequence_length"}
    past = {0: "batch", 2: "past_sequence_length"}
    axes = {"input_ids": dims, "features": dims, "hidden_in": dims, "past_key": past}
    axes = {**axes, "past_value": past, "hidden_out": dims, "draft_token": {0: "batch"}}
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            torch.onnx.export(
                module,
                args,
                str(path),
                dynamo=False,
                opset_version=18,
                input_names=list(INPUTS),
                output_names=list(OUTPUTS),
                dynamic_axes=axes,
            )
    except Exception as e:  # noqa: BLE001 - the exporter raises many kinds
        raise ExportError(f"exporting the EAGLE draft head failed: {e}") from e
    finally:
        head.embed = saved


def quantize_draft(graph: Path, out: Path) -> None:
    """``graph`` with its MatMul weights in int8 (one scale per output channel; activations
    quantized per run by onnxruntime's dynamic quantization), written to ``out``.

    A draft run multiplies one position by every weight of the head, so on a CPU its time is
    the bytes of the weights it reads (the 8,192-row LM head alone a third of it). Measured on
    SmolLM2-135M's head (one thread, 200 past positions, machine loaded by a training run):
    4.8 ms a run in float32 against 1.4-2.7 ms in int8; over the model's answers to the 16
    chat prompts (1,494 positions) the first draft's accuracy was 0.2718 in float32 and
    0.2711 in int8 (the same token at 93% of positions). Drafts never change the output (the
    target verifies them), only how often they are accepted."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from specport.core.errors import ExportError

    # the quantizer advises pre-processing through the root logger (which also installs a
    # stderr handler when there is none): neither belongs on the user's terminal
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    root.setLevel(logging.ERROR)
    try:
        quantize_dynamic(
            str(graph),
            str(out),
            weight_type=QuantType.QInt8,
            op_types_to_quantize=["MatMul"],
            per_channel=True,
            # shape inference stops at contrib operators (GroupQueryAttention); every MatMul
            # input here is float32
            extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT},
        )
    except Exception as e:  # noqa: BLE001 - the quantizer raises many kinds
        raise ExportError(f"quantizing the EAGLE draft head to int8 failed: {e}") from e
    finally:
        root.setLevel(level)
        for handler in root.handlers[:]:
            if handler not in handlers:
                root.removeHandler(handler)


def write_cpu_draft(head: EagleHead, graph: Path, out: Path, max_positions: int) -> str:
    """The graph the CPU provider runs, written to ``out``: the head on onnxruntime's fused
    attention (``eagle_graph``) with int8 weights, or ``graph`` (the TorchScript export) in
    int8 where the fused attention cannot take the head. Returns which attention it has.

    Measured on SmolLM2-135M's head (int8, one thread, the calls of 4 chat answers replayed):
    0.65-0.84 ms a run with the exported graph's ~120 nodes, 0.51-0.58 ms fused (33 nodes);
    between target runs, which evict its weights from the caches, 1.6-2.0 ms of head time per
    decode step against 1.36 ms; the same draft tokens on all 340 calls."""
    import onnx

    from specport.exporter.eagle_graph import fusable, fused_draft_graph

    reason = fusable(head.cfg)
    if reason:
        logger.info("the int8 draft graph keeps the exported attention: %s", reason)
        quantize_draft(graph, out)
        return "exported"
    fused = out.with_name(out.name + ".fused")
    try:
        onnx.save(fused_draft_graph(head, max_positions), str(fused))
        quantize_draft(fused, out)
    finally:
        fused.unlink(missing_ok=True)
    return "GroupQueryAttention"


def eagle_record(
    head: EagleHead,
    feature_report: dict[str, Any],
    training: dict[str, Any],
    int8_attention: str = "exported",
) -> dict[str, Any]:
    """The manifest's ``eagle`` entry."""
    return {
        "graph": DRAFT_FILE,
        "int8_graph": INT8_DRAFT_FILE,
        # "GroupQueryAttention": the CPU graph runs onnxruntime's fused attention
        # (``eagle_graph``); "exported": the TorchScript graph's own ops
        "int8_attention": int8_attention,
        "features": EAGLE_FEATURES,
        "feature_layers": feature_report.get("layers"),
        "inputs": list(INPUTS),
        "outputs": list(OUTPUTS),
        "kv": (
            "own KV, one layer [B, Hkv, P, Dh]; draft positions dropped after each verify; the "
            "fused graph takes seqlens_k / total_sequence_length, so the runtime keeps it in place"
        ),
        "config": head.cfg.to_json(),
        "draft_vocab": head.cfg.draft_vocab,
        "training": training,
    }
