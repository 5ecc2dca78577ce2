"""Shapes for graphs that arrive without them, and small constant evaluation on shape math.

Why: TorchScript exports (Optimum, onnxruntime's gpt2 helper) reshape heads with
`Reshape(x, Concat(Shape(x)[0], Shape(x)[1], -1, Dh))`, so plain ONNX inference leaves the head
count unknown and fusions cannot tell H from Hkv. onnxruntime's symbolic shape inference (the
one its transformers optimizer uses) resolves them; `infer_shapes` copies its answers onto the
onnx_ir values. `eval_scalar` folds the softmax scale these exports compute at run time from
`Shape(q)[-1]` (e.g. sqrt(1 / sqrt(Dh))) once Dh is known.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np
import onnx_ir as ir

logger = logging.getLogger(__name__)


def _dims(t: Any) -> list[int | str | None]:
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim]


def _better(old: ir.Shape | None, new: list[int | str | None]) -> bool:
    if old is None:
        return True
    if old.rank() != len(new):
        return False
    known_old = sum(isinstance(d, int) or bool(getattr(d, "value", None)) for d in old.dims)
    known_new = sum(d is not None for d in new)
    return known_new > known_old


def infer_shapes(model: ir.Model) -> dict[str, Any]:
    """Fill missing value shapes of the main graph from onnxruntime's symbolic inference.

    Weights are not needed (external tensors stay references). A failure is reported, not
    raised: fusion then falls back to the shapes the file carried.
    """
    try:
        from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

        proto = ir.serde.serialize_model(model)
        inferred = SymbolicShapeInference.infer_shapes(
            proto, auto_merge=True, guess_output_rank=True
        )
    except Exception as e:  # noqa: BLE001 - a graph it cannot read keeps its own shapes
        logger.info("symbolic shape inference failed: %s", e)
        return {"shape_inference": f"failed: {type(e).__name__}: {str(e)[:120]}"}
    shapes = {}
    for vi in [*inferred.graph.value_info, *inferred.graph.output]:
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.HasField("shape"):
            shapes[vi.name] = _dims(vi.type.tensor_type)
    filled = 0
    for node in model.graph:
        for out in node.outputs:
            dims = shapes.get(out.name or "")
            if dims is not None and _better(out.shape, dims):
                out.shape = ir.Shape(dims)
                filled += 1
    return {"shape_inference": "symbolic", "shapes_filled": filled}


def static_dim(v: ir.Value | None, axis: int) -> int | None:
    if v is None or v.shape is None or not (-v.shape.rank() <= axis < v.shape.rank()):
        return None
    d = v.shape[axis]
    return d if isinstance(d, int) else None


_UNARY: dict[str, Any] = {
    "Sqrt": np.sqrt,
    "Reciprocal": np.reciprocal,
    "Neg": np.negative,
    "Identity": lambda x: x,
}
_BINARY: dict[str, Any] = {
    "Mul": np.multiply,
    "Div": np.divide,
    "Add": np.add,
    "Sub": np.subtract,
    "Pow": np.power,
}


def eval_const(v: ir.Value | None, depth: int = 12) -> np.ndarray | None:
    """Value of `v` when it is a constant or computed from constants and static dims."""
    if v is None or depth < 0:
        return None
    if v.const_value is not None:
        return np.asarray(v.const_value.numpy())
    node = v.producer()
    if node is None or node.domain not in ("", "ai.onnx"):
        return None
    op = node.op_type
    if op == "Shape":
        x = node.inputs[0]
        if x is None or x.shape is None:
            return None
        rank = x.shape.rank()
        start = node.attributes.get_int("start", 0)
        end = node.attributes.get_int("end", rank)
        dims = list(x.shape.dims)[slice(start, end)]
        return np.asarray(dims, np.int64) if all(isinstance(d, int) for d in dims) else None
    if op == "Gather" and node.inputs[0] is not None:
        src = node.inputs[0].producer()
        idx = eval_const(node.inputs[1], depth - 1)
        plain = src is not None and src.op_type == "Shape" and not src.attributes
        if src is not None and plain and idx is not None and idx.size == 1:
            d = static_dim(src.inputs[0], int(idx.reshape(-1)[0]))  # only that dim must be static
            return None if d is None else np.asarray(d, np.int64)
    if op == "Slice" and node.inputs[0] is not None:
        src = node.inputs[0].producer()
        if src is not None and src.op_type == "Shape" and src.inputs[0] is not None:
            # Slice of a shape: only the sliced dims need to be static.
            x = src.inputs[0]
            if x.shape is None:
                return None
            bounds = [eval_const(i, depth - 1) for i in node.inputs[1:3]]
            if any(b is None for b in bounds):
                return None
            start, end = (int(b.reshape(-1)[0]) for b in bounds)  # type: ignore[union-attr]
            dims = list(x.shape.dims)[slice(start, end)]
            if not all(isinstance(d, int) for d in dims):
                return None
            return np.asarray(dims, np.int64)
    args = [eval_const(i, depth - 1) for i in node.inputs]
    if any(a is None for a in args):
        return None
    if op in _UNARY:
        return np.asarray(_UNARY[op](args[0].astype(np.float64)))  # type: ignore[union-attr]
    if op in _BINARY:
        a, b = (x.astype(np.float64) for x in args)  # type: ignore[union-attr]
        return np.asarray(_BINARY[op](a, b))
    if op == "Cast":
        return args[0].astype(ir.DataType(node.attributes.get_int("to", 1)).numpy())  # type: ignore[union-attr]
    if op in ("Squeeze", "Unsqueeze", "Reshape", "Flatten"):
        return args[0].reshape(-1)  # type: ignore[union-attr]
    return None


def eval_scalar(v: ir.Value | None) -> float | None:
    arr = eval_const(v)
    if arr is None or arr.size != 1:
        return None
    out = float(arr.reshape(-1)[0])
    return out if math.isfinite(out) else None
