"""Int8 KV cache on the shared layout: GroupQueryAttention reads and writes an int8 buffer itself.

On the `shared` layout (passes/shared_kv.py) each layer's past input and present output are one
preallocated buffer [B, Hkv, T, D] that com.microsoft.GroupQueryAttention writes in place. Since
onnxruntime 1.32 the operator takes that buffer as int8 (`kv_cache_bit_width=8`,
`k_quant_type` / `v_quant_type`, scales as inputs 12 `k_scale` and 13 `v_scale`): it writes the
new positions as clip(round(x / scale)) and attends to every position, the new ones included,
through the dequantized cache. So no QuantizeLinear / DequantizeLinear nodes are added and a
token's logits do not depend on how the sequence was split into runs (measured on onnxruntime
1.32's CPU kernel: one run of 3 tokens and 3 runs of 1 give bit-identical outputs and cache
bytes, in prefill and on a past), which keeps greedy speculative decoding token-exact.

Contract after the pass, per layer i and kind in key/value:
  input  `past_key_values.{i}.{kind}` int8 [B, Hkv, T, D]   (bound to the output, in place)
  output `present.{i}.{kind}`          int8 [B, Hkv, T, D]
  GroupQueryAttention: kv_cache_bit_width=8, {k,v}_quant_type, inputs 12/13 = scale initializers

Scale granularity is what the kernel offers (onnxruntime's schema: "PER_TENSOR" scale [1],
"PER_CHANNEL" scale [1, Hkv, 1, D]; a per-head scale [1, Hkv, 1, 1] is refused at run time, so a
per-KV-head scale is written as PER_CHANNEL with the head's scale repeated over D). Symmetric,
zero point 0; scales come from passes/quant/kv_calibration.py run on the shared graph.

`float_layers` keeps those layers' caches float32: the bit width is an attribute of each
GroupQueryAttention node (the kernel requires k_quant_type == v_quant_type, so a layer's key
and value share it), and the runtime allocates each layer's buffer in its own dtype
(manifest `kv.layer_dtypes`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx_ir as ir

from specport.core.errors import QuantizationError
from specport.passes.base import Pass
from specport.passes.quant.graph import add_initializer

logger = logging.getLogger(__name__)

# What `quantize --kv-granularity` accepts on the shared layout, and the kernel's quant type.
GRANULARITIES = {
    "per_channel": "PER_CHANNEL",
    "per_kv_head": "PER_CHANNEL",
    "per_tensor": "PER_TENSOR",
}
_PAST = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")
_PRESENT = re.compile(r"^present\.(\d+)\.(key|value)$")
_SCALE_INPUTS = {"key": 12, "value": 13}
_INPUT_COUNT = 14


def is_shared_graph(model: ir.Model) -> bool:
    """True for a shared-layout graph (it takes seqlens_k / total_sequence_length itself)."""
    return bool({"seqlens_k", "total_sequence_length"} & {v.name for v in model.graph.inputs})


def kernel_scale(scale: np.ndarray, granularity: str, heads: int, dim: int) -> np.ndarray:
    """A calibrated scale ([Hkv], [Hkv, D] or scalar) as the kernel's scale input.

    per_tensor -> [1]; per_kv_head and per_channel -> [1, Hkv, 1, D] (a head's scale repeated)."""
    s = np.asarray(scale, np.float32)
    if granularity == "per_tensor":
        if s.size != 1:
            raise QuantizationError(f"a per-tensor KV scale has one value, got shape {s.shape}")
        return s.reshape(1)
    if granularity == "per_kv_head":
        if s.shape != (heads,):
            raise QuantizationError(f"a per-KV-head scale has shape ({heads},), got {s.shape}")
        s = np.repeat(s[:, None], dim, axis=1)
    if s.shape != (heads, dim):
        raise QuantizationError(f"a per-channel KV scale has shape ({heads}, {dim}), got {s.shape}")
    return np.ascontiguousarray(s.reshape(1, heads, 1, dim))


def _gqa_nodes(model: ir.Model) -> list[ir.Node]:
    return [
        n for n in model.graph if n.op_type == "GroupQueryAttention" and n.domain == "com.microsoft"
    ]


class QuantizeSharedKVCachePass(Pass):
    """Make every in-place KV buffer int8, read and written by GroupQueryAttention itself."""

    name = "quantize_kv_cache"

    def __init__(
        self,
        scales: dict[str, np.ndarray],
        granularity: str = "per_channel",
        float_layers: Sequence[int] = (),
    ) -> None:
        if granularity not in GRANULARITIES:
            raise QuantizationError(
                f"unknown KV scale granularity {granularity!r}; choose one of "
                f"{', '.join(GRANULARITIES)}"
            )
        self.scales = scales  # present name -> scale (see kernel_scale)
        self.granularity = granularity
        self.float_layers = sorted({int(i) for i in float_layers})

    def precondition(self, model: ir.Model) -> str | None:
        g = model.graph
        if not is_shared_graph(model):
            return "not a shared KV layout graph (no seqlens_k input)"
        pasts = [v for v in g.inputs if v.name and _PAST.match(v.name)]
        if not pasts:
            return "no past_key_values.* inputs"
        if any(v.dtype != ir.DataType.FLOAT for v in pasts):
            return "past_key_values.* inputs are not float32 (already quantized?)"
        for v in pasts:
            users = {(u.node.op_type, u.node.domain, u.idx) for u in v.uses()}
            if not users or any(
                op != "GroupQueryAttention" or dom != "com.microsoft" or idx not in (3, 4)
                for op, dom, idx in users
            ):
                return f"{v.name} is read by something other than GroupQueryAttention's cache input"
        return None

    def rewrite(self, model: ir.Model) -> tuple[bool, dict[str, Any]]:
        g = model.graph
        quant_type = GRANULARITIES[self.granularity]
        int8 = ir.TensorType(ir.DataType.INT8)
        done: dict[str, ir.Value] = {}  # present name -> its scale initializer
        kept: set[str] = set()  # present outputs of the layers that stay float32
        layers = 0
        for node in _gqa_nodes(model):
            pairs = [(node.inputs[3], node.outputs[1]), (node.inputs[4], node.outputs[2])]
            names = [((p.name or "") if p is not None else "", o.name or "") for p, o in pairs]
            matched = [(_PAST.match(p), _PRESENT.match(o)) for p, o in names]
            if not any(mp for mp, _ in matched):
                continue  # a GroupQueryAttention without a graph cache: not ours to change
            if not all(mp and mo and mp.groups() == mo.groups() for mp, mo in matched):
                raise QuantizationError(
                    f"GroupQueryAttention {node.name!r} reads {names}: its past inputs and present "
                    "outputs do not pair up as past_key_values.{i}.key/value -> present.{i}.*"
                )
            if int(matched[0][0][1]) in self.float_layers:  # type: ignore[index]
                kept.update(o.name or "" for _, o in pairs)
                continue
            for (past, present), (mp, _) in zip(pairs, matched):
                assert past is not None and mp is not None
                layer, kind = mp[1], mp[2]
                if present.name in done:
                    raise QuantizationError(f"{present.name} is written by two attention nodes")
                heads, dim = _heads_dim(past)
                scale = kernel_scale(self._scale(present.name or ""), self.granularity, heads, dim)
                sv = add_initializer(g, f"/model/layers.{layer}/kv_cache/{kind}/scale", scale)
                while len(node.inputs) < _INPUT_COUNT:
                    node.resize_inputs(len(node.inputs) + 1)
                node.replace_input_with(_SCALE_INPUTS[kind], sv)
                past.type = present.type = int8
                done[present.name or ""] = sv
            node.attributes["kv_cache_bit_width"] = ir.AttrInt64("kv_cache_bit_width", 8)
            for attr in ("k_quant_type", "v_quant_type"):
                node.attributes[attr] = ir.AttrString(attr, quant_type)
            layers += 1
        outputs = {v.name for v in g.outputs if v.name and _PRESENT.match(v.name)}
        missing_layers = set(self.float_layers) - {int(_PRESENT.match(n)[1]) for n in kept}  # type: ignore[index]
        if missing_layers:
            raise QuantizationError(
                f"--kv-float-layers names layers {sorted(missing_layers)} that have no "
                f"GroupQueryAttention cache; the model's layers are 0..{len(outputs) // 2 - 1}"
            )
        if not done or set(done) | kept != outputs:
            missing = sorted(outputs - set(done) - kept)
            raise QuantizationError(
                f"int8 KV on the shared layout needs every present output written by "
                f"GroupQueryAttention; not: {', '.join(missing) or 'none found'}"
            )
        return True, {
            "dtype": "int8",
            "layout": "shared",
            "symmetric": True,
            "granularity": self.granularity,
            "quant_type": quant_type,
            # GroupQueryAttention quantizes the new positions into the cache and attends to
            # every position through it: logits do not depend on the split into runs.
            "current_step": "int8",
            "attention_layers": layers,
            "float_layers": self.float_layers,
            "scales": {
                name: _summary(np.asarray(self.scales[name], np.float32)) for name in sorted(done)
            },
        }

    def _scale(self, present: str) -> np.ndarray:
        if present not in self.scales:
            raise QuantizationError(f"no calibrated KV scale for {present}")
        return np.asarray(self.scales[present], np.float32)


def _heads_dim(past: ir.Value) -> tuple[int, int]:
    shape = past.shape
    if (
        shape is None
        or shape.rank() != 4
        or not all(isinstance(d, int) for d in (shape[1], shape[3]))
    ):
        raise QuantizationError(f"{past.name} has shape {shape}; expected [B, Hkv, T, D]")
    return int(shape[1]), int(shape[3])  # type: ignore[arg-type]


def _summary(scale: np.ndarray) -> list[float] | dict[str, Any]:
    """What the manifest records of a scale: per-head values, or per head min/max over D."""
    if scale.ndim <= 1:
        return [round(float(s), 8) for s in scale.reshape(-1)]
    return {
        "shape": list(scale.shape),
        "head_max": [round(float(s), 8) for s in scale.max(axis=1)],
        "head_min": [round(float(s), 8) for s in scale.min(axis=1)],
    }
