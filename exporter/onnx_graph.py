"""The exported ONNX graph: trace it from PyTorch, write it, open it for verification, and
describe its inputs and outputs for the manifest.

Kept apart from export.py's orchestration because memory is decided here: weights stay views of
the PyTorch parameters (or lazy transposes of them) until written, one tensor at a time.
"""

from __future__ import annotations

import logging
import time
import warnings
from pathlib import Path
from typing import Any

import onnx_ir as ir

from specport.artifact import manifest as art
from specport.core.contract import TREE_MASK
from specport.core.errors import ExportError
from specport.exporter.traced_optimizer import optimize_traced
from specport.exporter.weights import detach_weights, fold_weight_transposes, release_weights
from specport.exporter.wrapper import (
    FlatKVWrapper,
    TreeMaskKVWrapper,
    dynamic_shapes,
    example_inputs,
    kv_input_names,
    kv_output_names,
)

logger = logging.getLogger(__name__)

OPSET = 23


def trace_to_onnx(
    torch_model: Any,
    kv_shapes: list[tuple[int, int, int]],
    vocab_size: int,
    tree_mask: bool = False,
    checkpoint: Any = None,
    bindings: dict[int, str] | None = None,
) -> ir.Model:
    """torch.onnx.export (dynamo) of the flat-KV wrapper; weights become lazy initializers.

    With `checkpoint` and `bindings` (from `streaming_model`) the model's parameters hold no
    data and every initializer reads its tensor from the checkpoint when written.
    """
    import torch

    num_layers = len(kv_shapes)
    # torch's exporter logs one line per optional op library it cannot find (torchvision).
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    wrapper_cls = TreeMaskKVWrapper if tree_mask else FlatKVWrapper
    wrapper = wrapper_cls(torch_model, num_layers).eval()
    args = example_inputs(vocab_size, kv_shapes, tree_mask=tree_mask)
    t0 = time.perf_counter()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        try:
            program = torch.onnx.export(
                wrapper,
                args,
                dynamic_shapes=dynamic_shapes(num_layers, tree_mask=tree_mask),
                dynamo=True,
                opset_version=OPSET,
                input_names=[
                    "input_ids",
                    "attention_mask",
                    "position_ids",
                    *([TREE_MASK] if tree_mask else []),
                    *kv_input_names(num_layers),
                ],
                output_names=["logits", *kv_output_names(num_layers)],
                verbose=False,
                # The default optimize=True folds every weight Transpose into a fresh array
                # while the PyTorch model still holds the weights (a second full copy).
                # Fold them lazily instead, then run the same optimizer (weights.py).
                optimize=False,
            )
            if program is None:
                raise ExportError("torch.onnx.export returned no program; upgrade torch (>= 2.6).")
            detach_weights(program.model, checkpoint=checkpoint, bindings=bindings)
            fold_weight_transposes(program.model)
            optimize_traced(program.model)  # ONNXProgram.optimize(), in linear time
        except ExportError:
            raise
        except Exception as e:  # noqa: BLE001 - the exporter raises many kinds
            raise ExportError(
                f"torch.onnx.export failed for {type(torch_model).__name__}: {e}"
            ) from e
    logger.info("traced in %.1fs", time.perf_counter() - t0)
    model = program.model
    # The initializers are views of the PyTorch parameters (or lazy transposes of them): drop
    # the ExportedProgram so nothing else pins a copy.
    del program
    model.producer_name = "specport"
    return model


def save_artifact_model(model: ir.Model, path: Path, release: bool = True) -> None:
    """Write `model` with its weights as external data, one tensor in flight at a time.

    onnx_ir writes with a thread pool and up to 1 GiB of tensors materialized at once; lazily
    transposed weights are materialized on write, so one worker keeps the transient to the
    largest single tensor. `release` then empties the in-memory initializers (the model is
    unusable afterwards) so the weights are freed before onnxruntime loads the saved copy.
    """
    ir.save(model, path, external_data=art.DATA_NAME, max_workers=1)
    if release:
        release_weights(model)


def verification_session(path: Path) -> Any:
    """An onnxruntime CPU session for `compare` that adds no copy of the weights.

    onnxruntime maps the external data file; by default it then repacks every MatMul weight
    into a private buffer and folds the tied LM head's Transpose into a new initializer (one
    more copy of the weights, plus the embedding again). Verification runs a few tiny
    batches, so it reads the mapped weights as they are (same kernels' arithmetic, without
    the packed layout): peak memory stays at one, file-backed, copy.
    """
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.add_session_config_entry("session.disable_prepacking", "1")
    return ort.InferenceSession(
        str(path),
        so,
        providers=["CPUExecutionProvider"],
        disabled_optimizers=["ConstantFolding"],
    )


def io_signature(model_path: Path) -> dict[str, list[dict[str, Any]]]:
    import onnx

    proto = onnx.load(str(model_path), load_external_data=False)

    def describe(values: Any) -> list[dict[str, Any]]:
        out = []
        for v in values:
            t = v.type.tensor_type
            dims = [d.dim_param if d.dim_param else d.dim_value for d in t.shape.dim]
            out.append(
                {
                    "name": v.name,
                    "dtype": onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name,
                    "shape": dims,
                }
            )
        return out

    return {"inputs": describe(proto.graph.input), "outputs": describe(proto.graph.output)}
