"""Build one-node models around a `specport` op (tests and lowering checks use them)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx_ir as ir
from onnx import helper

from specport.custom_ops._base import DOMAIN, STD_OPSET, VERSION, attach_functions


def single_op_model(
    op_type: str,
    inputs: dict[str, np.ndarray],
    n_outputs: int,
    attrs: dict[str, Any] | None = None,
    domain: str = DOMAIN,
) -> ir.Model:
    """A model with one `domain.op_type` node fed by graph inputs shaped like `inputs`.

    Input dims are symbolic so the same model runs on other shapes; outputs are untyped-shape.
    """
    vis = []
    for name, arr in inputs.items():
        dims = [f"{name}_{i}" for i in range(arr.ndim)]
        vis.append(
            helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(arr.dtype), dims)
        )
    outs = [f"out{i}" for i in range(n_outputs)]
    node = helper.make_node(op_type, list(inputs), outs, domain=domain, **(attrs or {}))
    ftype = helper.np_dtype_to_tensor_dtype(next(iter(inputs.values())).dtype)
    ovis = [helper.make_tensor_value_info(o, ftype, None) for o in outs]
    graph = helper.make_graph([node], "single", vis, ovis)
    proto = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", STD_OPSET), helper.make_opsetid(DOMAIN, VERSION)],
    )
    proto.ir_version = 11
    model = ir.serde.deserialize_model(proto)
    attach_functions(model)
    return model


def run(model: ir.Model, feeds: dict[str, np.ndarray], disable_opt: bool = False) -> list[Any]:
    """Run `model` in a bare CPU InferenceSession."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    if disable_opt:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    proto = ir.serde.serialize_model(model)
    sess = ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def output_names(model: ir.Model) -> Sequence[str]:
    return [v.name or "" for v in model.graph.outputs]
