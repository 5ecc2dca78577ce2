"""Convert a float32 graph to float16 or bfloat16: weights, activations and the KV cache.

Contract: every FLOAT tensor of the main graph (initializers, Constant nodes, graph inputs such as
`past_key_values.*`, intermediate values, `Cast(to=FLOAT)` targets, ConstantOfShape fills) becomes
`dtype`, except

- index arithmetic: values computed only from integers (`Cast(int -> float)`) and constants,
  e.g. rotary angles `position_ids * inv_freq` on the concat layout. Positions above 2048 are
  not even representable in float16, and an angle of 100 rad has an ulp of 0.06 there; those
  values stay float32 (as transformers computes them) and are cast where they meet activations;
- the op types in `keep_ops` (their inputs are cast to float32, their outputs back), and graph
  inputs only they read (e.g. the KV cache of a float32 attention);
- the graph outputs named in `float32_outputs` (`logits`): the last op's result is cast back to
  float32, so users, the sampler and the in-graph ArgMax (`next_token`) read float32 logits.

Values need their types (the torch exporter and specport's passes annotate every value).
Initializers are converted lazily (one tensor materialized at a time when the model is saved),
values beyond the target's finite range are clamped (float16: +-65504; masks built from
float32's lowest value stay finite). onnxruntime's `float16.convert_float_to_float16` does the
same job on a ModelProto, but it needs every float32 weight in memory at once plus its float16
copy and has no bfloat16; this pass keeps export's one-tensor-at-a-time weights.
"""

from __future__ import annotations

import logging
import warnings
from collections import Counter
from typing import Any

import onnx_ir as ir

from specport.passes.base import Pass

logger = logging.getLogger(__name__)

DTYPES = {"float16": ir.DataType.FLOAT16, "bfloat16": ir.DataType.BFLOAT16}
FLOAT = ir.DataType.FLOAT
_TYPE_BLIND = ("Shape", "Size")  # read no values: any dtype will do


def _cast_tensor(tensor: ir.TensorProtocol, dtype: ir.DataType, name: str) -> ir.TensorProtocol:
    """`tensor` as `dtype` (through torch, which has bfloat16), clamped to its finite range."""
    import torch

    target = torch.float16 if dtype == ir.DataType.FLOAT16 else torch.bfloat16
    with warnings.catch_warnings():  # read-only (memory-mapped) arrays: only read here
        warnings.simplefilter("ignore", UserWarning)
        data = torch.from_numpy(tensor.numpy())
    limit = torch.finfo(target).max
    data = data.clamp(-limit, limit).to(target)
    return ir.tensor_adapters.TorchTensor(data, name=name)


def _lazy_cast(tensor: ir.TensorProtocol, dtype: ir.DataType) -> ir.LazyTensor:
    name = tensor.name or ""
    return ir.LazyTensor(
        lambda: _cast_tensor(tensor, dtype, name),
        dtype=dtype,
        shape=ir.Shape(tensor.shape.numpy()),
        name=name,
    )


def _is_float(value: ir.Value | None) -> bool:
    return value is not None and value.dtype == FLOAT


def _is_constant(value: ir.Value) -> bool:
    producer = value.producer()
    return value.const_value is not None or (
        producer is not None and producer.op_type == "Constant"
    )


def index_arithmetic(graph: ir.Graph) -> tuple[set[ir.Node], set[ir.Value]]:
    """(nodes, values) that stay float32: the forward cone of `Cast(int -> float)` over constants.

    A node joins when one of its float inputs is such a value and the others are constants; the
    constants it reads stay float32 with it.
    """
    nodes: set[ir.Node] = set()
    values: set[ir.Value] = set()
    for node in graph:  # topological order
        floats = [v for v in node.inputs if _is_float(v)]
        seed = (
            node.op_type == "Cast"
            and node.attributes["to"].as_int() == FLOAT
            and node.inputs[0] is not None
            and node.inputs[0].dtype not in (FLOAT, *DTYPES.values(), ir.DataType.DOUBLE)
        )
        joins = bool(floats) and any(v in values for v in floats)
        joins = joins and all(v in values or _is_constant(v) for v in floats if v is not None)
        if not (seed or joins):
            continue
        nodes.add(node)
        values.update(v for v in floats if v is not None)
        values.update(v for v in node.outputs if _is_float(v))
    return nodes, values


class ConvertFloatsPass(Pass):
    """Float32 -> `dtype` ("float16" | "bfloat16") over the main graph; see the module doc."""

    name = "convert_floats"

    def __init__(
        self,
        dtype: str,
        float32_outputs: tuple[str, ...] = ("logits",),
        keep_ops: tuple[str, ...] = (),
    ) -> None:
        self.dtype = DTYPES[dtype]
        self.dtype_name = dtype
        self.float32_outputs = float32_outputs
        self.keep_ops = keep_ops  # op types computed in float32 (Casts around them)

    def precondition(self, model: ir.Model) -> str | None:
        if model.functions:
            return (
                "the graph carries ONNX functions (target neutral); convert after lowering "
                "to a target (cpu, cuda, cann)"
            )
        if not any(_is_float(v) for v in model.graph.inputs) and not any(
            v.dtype == FLOAT for v in model.graph.initializers.values()
        ):
            return "no float32 inputs or weights to convert"
        return None

    def rewrite(self, model: ir.Model) -> tuple[bool, dict[str, Any]]:
        graph = model.graph
        kept_nodes, kept = index_arithmetic(graph)
        for node in graph:
            if node.op_type in self.keep_ops:
                kept_nodes.add(node)
                for v in node.outputs:
                    if v.dtype is None and _is_float(node.inputs[0]):
                        v.dtype = FLOAT  # contrib ops' outputs may be untyped: T of input 0
                    if _is_float(v):
                        kept.add(v)
        weights = converted = 0
        for value in list(graph.initializers.values()):
            if value.dtype == FLOAT and value not in kept and value.const_value is not None:
                value.const_value = _lazy_cast(value.const_value, self.dtype)
                value.dtype = self.dtype
                weights += 1
        for value in graph.inputs:
            if not _is_float(value):
                continue
            users = [user for user, _ in value.uses() if user.op_type not in _TYPE_BLIND]
            if users and all(user in kept_nodes for user in users):
                kept.add(value)  # read only by float32 ops (a KV input of kept attention)
            else:
                value.dtype = self.dtype
        for node in list(graph):
            if node in kept_nodes:
                continue
            self._convert_attributes(node)
            for value in node.outputs:
                if _is_float(value):
                    value.dtype = self.dtype
                    converted += 1
        casts = self._cast_boundaries(graph, kept_nodes, kept)
        outputs = self._float32_outputs(graph)
        return True, {
            "dtype": self.dtype_name,
            "weights_converted": weights,
            "values_converted": converted,
            "kept_float32": dict(sorted(Counter(n.op_type for n in kept_nodes).items())),
            "boundary_casts": casts,
            "float32_outputs": outputs,
        }

    def _convert_attributes(self, node: ir.Node) -> None:
        """Cast targets, Constant values and ConstantOfShape fills that say float32."""
        if node.domain not in ("", "ai.onnx"):
            return
        if node.op_type == "Cast" and node.attributes["to"].as_int() == FLOAT:
            node.attributes["to"] = ir.AttrInt64("to", self.dtype)
        if node.op_type in ("Constant", "ConstantOfShape"):
            attr = node.attributes.get("value")
            if attr is not None and attr.as_tensor().dtype == FLOAT:
                tensor = _cast_tensor(attr.as_tensor(), self.dtype, attr.as_tensor().name or "")
                node.attributes["value"] = ir.AttrTensor("value", tensor)

    def _cast_boundaries(
        self, graph: ir.Graph, kept_nodes: set[ir.Node], kept: set[ir.Value]
    ) -> int:
        """Cast each float32 value to `dtype` before the first converted node that reads it."""
        casts: dict[ir.Value, ir.Value] = {}
        up: dict[ir.Value, ir.Value] = {}
        for node in list(graph):
            if node in kept_nodes:
                for i, value in enumerate(node.inputs):
                    if value is None or value in kept or value.dtype != self.dtype:
                        continue
                    if value not in up:
                        cast = ir.node("Cast", [value], {"to": FLOAT}, name=f"{value.name}_to_f32")
                        cast.outputs[0].name = f"{value.name}_f32"
                        cast.outputs[0].dtype = FLOAT
                        cast.outputs[0].shape = value.shape
                        graph.insert_before(node, cast)
                        up[value] = cast.outputs[0]
                    node.replace_input_with(i, up[value])
                continue
            for i, value in enumerate(node.inputs):
                if value is None or value not in kept:
                    continue
                if value not in casts:
                    cast = ir.node(
                        "Cast",
                        [value],
                        {"to": self.dtype},
                        name=f"{value.name}_to_{self.dtype_name}",
                    )
                    cast.outputs[0].name = f"{value.name}_{self.dtype_name}"
                    cast.outputs[0].dtype = self.dtype
                    cast.outputs[0].shape = value.shape
                    graph.insert_before(node, cast)
                    casts[value] = cast.outputs[0]
                node.replace_input_with(i, casts[value])
        return len(casts)

    def _float32_outputs(self, graph: ir.Graph) -> list[str]:
        """Give each named output back as float32: its producer's result goes through a Cast."""
        done = []
        for index, value in enumerate(graph.outputs):
            if value.name not in self.float32_outputs or value.dtype != self.dtype:
                continue
            name = value.name
            value.name = f"{name}_{self.dtype_name}"
            out = ir.Value(name=name, type=ir.TensorType(FLOAT), shape=value.shape)
            for user, i in list(value.uses()):  # e.g. select_logits' ArgMax reads float32
                user.replace_input_with(i, out)
            cast = ir.node("Cast", [value], {"to": FLOAT}, outputs=[out], name=f"{name}_to_float32")
            producer = value.producer()
            graph.insert_after(producer, cast) if producer is not None else graph.append(cast)
            graph.outputs[index] = out
            done.append(name)
        return done
