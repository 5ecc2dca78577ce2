"""QDQ for NPUs: uint16 activations everywhere, symmetric per-channel int8 or 4-bit weights.

The format NPU toolchains converge on (Qualcomm's QNN HTP, onnxruntime's own QNN recipe, Olive,
ExecuTorch's QNN path): every float tensor between two ops passes through a static
QuantizeLinear -> DequantizeLinear pair, so the provider sees quantized op units
(DQ -> op -> Q) and runs them in integer arithmetic end to end; nothing is left in float that
would run in fp16 or fall back to the CPU.

- Activations: asymmetric uint16 (or uint8), one scale and zero point per tensor, from the
  min / max observed on calibration text (`collect_ranges`; 0 is always exactly
  representable). Data-movement ops (Reshape, Transpose, Gather, ...) keep their input's
  parameters on their output: a requantize there would be a wasted op on the NPU.
- MatMul weights W [K, N]: symmetric int8 per output channel (DequantizeLinear axis=1); or
  4-bit, either int4 per output channel (`weight_form="qdq"`, block_size 0: what the QNN HTP
  backend computes right), int4 blocked along K (`block_size` > 0, opset-21 blocked
  DequantizeLinear: right on the CPU provider, wrong numbers on the HTP emulator), or
  com.microsoft.MatMulNBits (`weight_form="matmulnbits"`, symmetric 4-bit blocks: HTP takes
  it only where K is a multiple of the block).
- Other float constants (norm scales, rotary caches, scalars) are quantized like activations
  (asymmetric per tensor, in the activation type): they are small and the NPU wants every
  input of a quantized op quantized.

Call interface (also used by the `qnn` target's export):

    ranges = collect_ranges(model_path, feeds)           # feeds: iterable of input dicts
    QuantizeQDQPass(ranges, weight_bits=8)(model)        # model: onnx_ir.Model, in place

`specport.passes.quant.npu` builds the pass for an artifact (calibration text -> feeds ->
ranges; default text: the built-in synthetic tiny-stories corpus).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from specport.core.errors import QuantizationError
from specport.passes.base import Pass
from specport.passes.quant.graph import (
    add_initializer,
    find_weight_matmuls,
    named,
    remove_unused,
    replace_node,
)

logger = logging.getLogger(__name__)

ACTIVATION_TYPES: dict[str, tuple[ir.DataType, type[np.generic], int]] = {
    "uint16": (ir.DataType.UINT16, np.uint16, 65535),
    "uint8": (ir.DataType.UINT8, np.uint8, 255),
}
WEIGHT_FORMS = ("qdq", "matmulnbits")
# Ops whose output holds the same values as (a subset or rearrangement of) their first input:
# the output keeps the input's quantization parameters.
DATA_MOVEMENT = frozenset(
    {
        "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Gather", "Slice",
        "Split", "Expand", "Identity", "Tile", "DepthToSpace", "SpaceToDepth",
    }
)  # fmt: skip
# Consumers that only read a tensor's shape or type: they keep the float tensor.
SHAPE_READERS = frozenset({"Shape", "Size"})
Range = tuple[float, float]


# --------------------------------------------------------------------------------- calibration


def candidate_tensors(proto: onnx.ModelProto) -> list[str]:
    """Names of every tensor in the main graph that may be a float activation: graph inputs
    and node outputs (their dtype is learned when the graph runs)."""
    inits = {i.name for i in proto.graph.initializer}
    names = [i.name for i in proto.graph.input if i.name not in inits]
    names += [o for n in proto.graph.node if n.op_type != "Constant" for o in n.output if o]
    return names


def collect_ranges(
    model: str | os.PathLike[str] | onnx.ModelProto,
    feeds: Iterable[Mapping[str, np.ndarray]],
    providers: Sequence[str] = ("CPUExecutionProvider",),
) -> dict[str, Range]:
    """Min / max of every float tensor of the fp32 graph over the runs `feeds`.

    Non-finite values (an additive -inf mask) are left out of the range: QuantizeLinear
    saturates them to the lowest code, which the consumers see as the range's minimum.
    `model` is a path (its external data is read in place) or an in-memory proto.
    """
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if isinstance(model, onnx.ModelProto):
        proto = onnx.ModelProto()
        proto.CopyFrom(model)
    else:
        path = Path(model)
        proto = onnx.load(str(path), load_external_data=False)
        so.add_session_config_entry(
            "session.model_external_initializers_file_folder_path", str(path.parent)
        )
    known = {o.name for o in proto.graph.output}
    names = candidate_tensors(proto)
    for name in names:
        if name not in known:
            proto.graph.output.append(onnx.ValueInfoProto(name=name))
    sess = ort.InferenceSession(proto.SerializeToString(), so, providers=list(providers))
    del proto
    ranges: dict[str, list[float]] = {}
    runs = 0
    for feed in feeds:
        for name, x in zip(names, sess.run(names, dict(feed))):
            if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.size == 0:
                continue
            lo, hi = float(x.min()), float(x.max())
            if not (np.isfinite(lo) and np.isfinite(hi)):
                finite = x[np.isfinite(x)]
                if finite.size == 0:
                    continue
                lo, hi = float(finite.min()), float(finite.max())
            r = ranges.setdefault(name, [lo, hi])
            r[0], r[1] = min(r[0], lo), max(r[1], hi)
        runs += 1
    if runs == 0:
        raise QuantizationError("calibration produced no runs; pass non-empty calibration text")
    logger.info("collected ranges of %d float tensors over %d runs", len(ranges), runs)
    return {k: (v[0], v[1]) for k, v in ranges.items()}


def merge_ranges(*all_ranges: Mapping[str, Range]) -> dict[str, Range]:
    """The union of several calibrations (e.g. a prefill graph's and a decode graph's)."""
    out: dict[str, Range] = {}
    for ranges in all_ranges:
        for k, (lo, hi) in ranges.items():
            a, b = out.get(k, (lo, hi))
            out[k] = (min(a, lo), max(b, hi))
    return out


# ------------------------------------------------------------------------------- the rewrite


def activation_qparams(lo: float, hi: float, qmax: int) -> tuple[float, int]:
    """Asymmetric per-tensor (scale, zero point) covering [lo, hi], always including 0."""
    lo, hi = min(float(lo), 0.0), max(float(hi), 0.0)
    scale = (hi - lo) / qmax if hi > lo else 1.0
    zp = int(np.clip(np.round(-lo / scale), 0, qmax))
    return scale, zp


def quantize_symmetric(
    w: np.ndarray, bits: int, block_size: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric signed weights: w [K, N] -> (q int8 [K, N], scale [N] or [ceil(K/g), N]).

    Per output channel when `block_size` is 0, else per block of `block_size` rows of K.
    Codes span [-(2^(b-1) - 1), 2^(b-1) - 1] (no -2^(b-1): symmetric around 0).
    """
    qmax = 2 ** (bits - 1) - 1
    if block_size <= 0:
        amax = np.abs(w).max(axis=0)
        scale = np.where(amax == 0, 1.0, amax / qmax).astype(np.float32)
        q = np.clip(np.round(w / scale), -qmax, qmax).astype(np.int8)
        return q, scale
    k, n = w.shape
    nb = -(-k // block_size)
    pad = np.zeros((nb * block_size, n), np.float32)
    pad[:k] = w
    blocks = pad.reshape(nb, block_size, n)
    amax = np.abs(blocks).max(axis=1)
    scale = np.where(amax == 0, 1.0, amax / qmax).astype(np.float32)
    q = np.clip(np.round(blocks / scale[:, None, :]), -qmax, qmax).astype(np.int8)
    return q.reshape(nb * block_size, n)[:k], scale


class QuantizeQDQPass(Pass):
    """Static QDQ: uint16 (or uint8) activations, symmetric 8- or 4-bit weights.

    `ranges` maps tensor names to calibrated (min, max) (see `collect_ranges`); a float tensor
    with no range stays float (reported as `unquantized`).
    """

    name = "quantize_qdq"
    activity = "inserting QDQ pairs"

    def __init__(
        self,
        ranges: Mapping[str, Range],
        weight_bits: int = 8,
        activation_type: str = "uint16",
        block_size: int = 0,
        weight_form: str = "qdq",
        keep_float_from: Sequence[str] = (),
    ) -> None:
        if weight_bits not in (4, 8):
            raise QuantizationError(f"QDQ weights are 8 or 4 bits, not {weight_bits}")
        if activation_type not in ACTIVATION_TYPES:
            raise QuantizationError(
                f"QDQ activations are {' or '.join(ACTIVATION_TYPES)}, not {activation_type!r}"
            )
        if weight_form not in WEIGHT_FORMS:
            raise QuantizationError(f"QDQ weight form is one of {', '.join(WEIGHT_FORMS)}")
        if weight_form == "matmulnbits" and (weight_bits != 4 or block_size <= 0):
            raise QuantizationError("the matmulnbits weight form is 4-bit with a block size")
        self.ranges = dict(ranges)
        self.weight_bits, self.block_size, self.weight_form = weight_bits, block_size, weight_form
        self.act_dtype, self.act_np, self.act_qmax = ACTIVATION_TYPES[activation_type]
        self.activation_type = activation_type
        self.keep_float_from = frozenset(keep_float_from)

    def precondition(self, model: ir.Model) -> str | None:
        if not self.ranges:
            return "no calibrated ranges"
        if not any(n.op_type == "MatMul" for n in model.graph):
            return "no MatMul to quantize"
        if any(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in model.graph):
            return "the graph is already quantized"
        return None

    def rewrite(self, model: ir.Model) -> tuple[bool, dict[str, Any]]:
        from onnx_ir.passes.common import LiftConstantsToInitializersPass

        LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0)(model)
        graph = model.graph
        weights = self._quantize_weights(model)
        ranges = self._propagate_ranges(graph)
        kept = self._kept_float(graph)
        quantized = unquantized = consts = 0
        skipped: list[str] = []
        for value in self._float_values(graph):
            name = value.name or ""
            uses = [(n, i) for n, i in value.uses() if not _reads_shape(n, i)]
            if not uses and not value.is_graph_output():
                continue
            if id(value) in kept or (
                value.is_initializer() and uses and all(_feeds_only(n, kept) for n, _ in uses)
            ):
                continue
            if value.is_initializer():
                arr = value.const_value.numpy() if value.const_value is not None else None  # type: ignore[union-attr]
                if arr is None or arr.dtype != np.float32:
                    continue
                self._quantize_constant(graph, value, uses, arr)
                consts += 1
                continue
            if name not in ranges:
                unquantized += 1
                skipped.append(name)
                continue
            self._insert_qdq(graph, value, uses, ranges[name])
            quantized += 1
        remove_unused(model)
        if model.opset_imports.get("", 0) < 21:
            model.opset_imports[""] = 21
        if self.weight_form == "matmulnbits" and model.opset_imports.get("com.microsoft", 0) < 1:
            model.opset_imports["com.microsoft"] = 1
        return True, {
            "activation_type": self.activation_type,
            "weight_bits": self.weight_bits,
            "weight_form": self.weight_form,
            "block_size": self.block_size,
            "weights": len(weights),
            "activations_quantized": quantized,
            "constants_quantized": consts,
            "unquantized": unquantized,
            "kept_float": len(kept),
            "unquantized_names": skipped[:10],
            "layers": weights,
        }

    # -- weights

    def _quantize_weights(self, model: ir.Model) -> dict[str, Any]:
        """MatMul(x, W) -> MatMul(x, DQ(Wq)) or MatMulNBits(x, ...), symmetric weights."""
        graph = model.graph
        layers: dict[str, Any] = {}
        for site in find_weight_matmuls(model):
            w = site.weight_array()
            base = site.name
            if self.weight_form == "matmulnbits":
                node = _matmul_nbits(graph, site.x, w, self.block_size, base)
                replace_node(graph, site.node, [node], node.outputs[0])
            else:
                q, scale = quantize_symmetric(w, self.weight_bits, self.block_size)
                qdt = ir.DataType.INT8 if self.weight_bits == 8 else ir.DataType.INT4
                qv = add_initializer(graph, f"{base}.wq", q)
                if qdt != ir.DataType.INT8:
                    qv.const_value = ir.tensor(q, dtype=qdt, name=qv.name)
                    qv.type = ir.TensorType(qdt)
                sv = add_initializer(graph, f"{base}.wq_scale", scale)
                zv = add_initializer(graph, f"{base}.wq_zero", np.zeros(scale.shape, np.int8))
                if qdt != ir.DataType.INT8:
                    zv.const_value = ir.tensor(
                        np.zeros(scale.shape, np.int8), dtype=qdt, name=zv.name
                    )
                    zv.type = ir.TensorType(qdt)
                attrs: dict[str, Any] = {"axis": 1}
                if self.block_size > 0:
                    attrs = {"axis": 0, "block_size": self.block_size}
                dq = ir.node(
                    "DequantizeLinear",
                    [qv, sv, zv],
                    attrs,
                    name=f"{base}/DequantizeLinearW",
                )
                mm = ir.node("MatMul", [site.x, dq.outputs[0]], name=f"{base}/MatMul")
                replace_node(graph, site.node, [dq, mm], mm.outputs[0])
            layers[base] = {
                "bits": self.weight_bits,
                "activation_bits": 16 if self.activation_type == "uint16" else 8,
                "symmetric": True,
                "granularity": "per_channel" if self.block_size <= 0 else "blocked",
                "lm_head": site.lm_head,
            }
        remove_unused(model)
        return layers

    # -- activations

    def _float_values(self, graph: ir.Graph) -> list[ir.Value]:
        """Graph inputs, initializers and node outputs that are (or may be) float tensors, in
        graph order; weight codes and the new DQ outputs are excluded."""
        values: list[ir.Value] = [v for v in graph.inputs if v.dtype in (ir.DataType.FLOAT, None)]
        values += [v for v in graph.initializers.values() if v.dtype == ir.DataType.FLOAT]
        for node in list(graph):
            if node.op_type in ("DequantizeLinear", "QuantizeLinear"):
                continue  # the weights' own DQ
            values += [o for o in node.outputs if o.dtype in (ir.DataType.FLOAT, None)]
        seen: set[int] = set()
        out = []
        for v in values:
            if id(v) not in seen:
                seen.add(id(v))
                out.append(v)
        return out

    def _kept_float(self, graph: ir.Graph) -> set[int]:
        """Ids of float tensors computed from the `keep_float_from` inputs alone (rotary
        angles and masks built from position_ids / attention_mask): their range is the
        context window, not the text, and uint16 over 8k positions is a step of 0.125."""
        if not self.keep_float_from:
            return set()
        deps: dict[int, frozenset[str]] = {id(v): frozenset({v.name or ""}) for v in graph.inputs}
        kept: set[int] = set()
        for node in graph:
            d: frozenset[str] = frozenset().union(
                *(deps.get(id(v), frozenset()) for v in node.inputs if v is not None)
            )
            for out in node.outputs:
                deps[id(out)] = d
                if d and d <= self.keep_float_from and out.dtype in (ir.DataType.FLOAT, None):
                    kept.add(id(out))
        return kept

    def _propagate_ranges(self, graph: ir.Graph) -> dict[str, Range]:
        """Calibrated ranges, with data-movement outputs taking their input's range."""
        ranges = dict(self.ranges)
        for node in graph:
            if node.op_type not in DATA_MOVEMENT or not node.inputs or node.inputs[0] is None:
                continue
            src = node.inputs[0]
            if src.name in ranges:
                for out in node.outputs:
                    if out.name in ranges:
                        ranges[out.name or ""] = ranges[src.name or ""]
        return ranges

    def _insert_qdq(
        self, graph: ir.Graph, value: ir.Value, uses: list[tuple[ir.Node, int]], rng: Range
    ) -> None:
        """value -> Q -> DQ; consumers (and a graph output of that name) read the DQ output."""
        scale, zp = activation_qparams(rng[0], rng[1], self.act_qmax)
        base = value.name or "x"
        sv = add_initializer(graph, f"{base}.qscale", np.array(scale, dtype=np.float32))
        zv = add_initializer(graph, f"{base}.qzero", np.array(zp, dtype=self.act_np))
        q = named(ir.node("QuantizeLinear", [value, sv, zv], name=f"{base}/QuantizeLinear"))
        dq = named(
            ir.node("DequantizeLinear", [q.outputs[0], sv, zv], name=f"{base}/DequantizeLinear")
        )
        out = dq.outputs[0]
        out.type, out.shape = ir.TensorType(ir.DataType.FLOAT), value.shape
        prod = value.producer()
        if prod is None:
            graph.insert_before(next(iter(graph)), [q, dq])
        else:
            graph.insert_after(prod, [q, dq])
        for node, idx in uses:
            node.replace_input_with(idx, out)
        if value.is_graph_output():
            outputs = graph.outputs
            i = next(j for j, o in enumerate(outputs) if o is value)
            name = value.name
            value.name = f"{name}.float"
            out.name = name
            outputs[i] = out

    def _quantize_constant(
        self, graph: ir.Graph, value: ir.Value, uses: list[tuple[ir.Node, int]], arr: np.ndarray
    ) -> None:
        """A float constant feeding an op -> DQ(codes) in the activation type, per tensor."""
        finite = arr[np.isfinite(arr)]
        lo = float(finite.min()) if finite.size else 0.0
        hi = float(finite.max()) if finite.size else 0.0
        scale, zp = activation_qparams(lo, hi, self.act_qmax)
        codes = np.clip(np.round(arr / scale) + zp, 0, self.act_qmax).astype(self.act_np)
        base = value.name or "const"
        cv = add_initializer(graph, f"{base}.q", codes)
        sv = add_initializer(graph, f"{base}.qscale", np.array(scale, dtype=np.float32))
        zv = add_initializer(graph, f"{base}.qzero", np.array(zp, dtype=self.act_np))
        dq = named(ir.node("DequantizeLinear", [cv, sv, zv], name=f"{base}/DequantizeLinear"))
        dq.outputs[0].type, dq.outputs[0].shape = ir.TensorType(ir.DataType.FLOAT), value.shape
        first = min((n for n, _ in uses), key=lambda n: _position(graph, n))
        graph.insert_before(first, [dq])
        for node, idx in uses:
            node.replace_input_with(idx, dq.outputs[0])


def _feeds_only(node: ir.Node, kept: set[int]) -> bool:
    """True when every float output of `node` stays float (a constant feeding it stays too)."""
    outs = [o for o in node.outputs if o.dtype in (ir.DataType.FLOAT, None)]
    return bool(outs) and all(id(o) in kept for o in outs)


def _reads_shape(node: ir.Node, index: int) -> bool:
    """True for uses that need no QDQ: shape/type readers and quantization parameters."""
    if node.op_type in ("QuantizeLinear", "DequantizeLinear", "MatMulNBits"):
        return index > 0
    return node.op_type in SHAPE_READERS or (node.op_type == "CastLike" and index == 1)


def _position(graph: ir.Graph, node: ir.Node) -> int:
    for i, n in enumerate(graph):
        if n is node:
            return i
    return 0


def _matmul_nbits(graph: ir.Graph, x: ir.Value, w: np.ndarray, block: int, base: str) -> ir.Node:
    """com.microsoft.MatMulNBits, symmetric 4-bit blocks (zero point 8 in uint4 codes)."""
    k, n = w.shape
    q, scale = quantize_symmetric(w, 4, block)  # q [K, N] in [-7, 7], scale [nb, N]
    nb = scale.shape[0]
    codes = np.full((nb * block, n), 8, np.uint8)
    codes[:k] = (q.astype(np.int16) + 8).astype(np.uint8)
    codes = codes.T.reshape(n, nb, block)  # [N, nb, block]
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)  # [N, nb, block/2]
    bv = add_initializer(graph, f"{base}.q4", packed)
    sv = add_initializer(graph, f"{base}.q4_scale", np.ascontiguousarray(scale.T).reshape(-1))
    attrs = {"K": k, "N": n, "bits": 4, "block_size": block}
    return ir.node(
        "MatMulNBits", [x, bv, sv], attrs, domain="com.microsoft", name=f"{base}/MatMulNBits"
    )
