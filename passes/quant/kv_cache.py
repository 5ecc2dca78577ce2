"""Int8 KV cache: the concat graph reads and writes its cache as int8 with calibrated scales.

Contract after the pass (concat layout, per layer i and kind in key/value):
  input  `past_key_values.{i}.{kind}` int8 [B, Hkv, P, D]
         -> DequantizeLinear(past, scale [Hkv], zero int8 [Hkv], axis=1) -> original consumers
  output `present.{i}.{kind}` int8 [B, Hkv, P+S, D]
         <- QuantizeLinear(present_float, scale [Hkv], zero int8 [Hkv], axis=1)
Symmetric (zero point 0) per-KV-head scales, so q = clip(round(x / scale), -128, 127) and
x ~ q * scale. Because present = concat(dequant(past), new), re-quantizing it with the same
scale gives back the past bytes exactly: only the new positions pick up rounding error, and the
error does not grow with the number of decode steps.

Attention reads every position, the new ones included, through int8, so a token's logits do not
depend on how the sequence was split into runs (one prefill = token-by-token decode; greedy
speculative decoding stays token-exact with plain greedy):
  - unfused graphs read the concatenated present: that read goes through
    DequantizeLinear(present int8), and `Concat(dequant(past), new)` becomes
    `Concat(past, quant(new))` (no requantizing the whole cache every step);
  - com.microsoft GroupQueryAttention (fused exports) concatenates
    internally: its new key/value inputs [B, S, Hkv*D] are round-tripped through int8 first.
Any other attention reads its new positions in float (later runs read them as int8); the
report's `current_step` says "int8" or "float". Measured on stories260K (calibration: first 300
documents, evaluation: last 500, fp32 5.2647): int8 KV 5.2805 (+0.30%), fused or unfused, in
one pass or token by token.

Scales (passes/quant/kv_calibration.py) are calibrated on the graph the pass is applied to: the
fp32 artifact, or the graph after the weight passes (W4A16 + int8 KV on stories260K: +1.01%
over W4A16 alone, against +1.37% with scales from the fp32 graph).
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from specport.artifact.manifest import Manifest
from specport.core.errors import QuantizationError
from specport.passes.base import Pass
from specport.passes.quant.graph import add_initializer, named, remove_unused
from specport.passes.quant.kv_cache_shared import QuantizeSharedKVCachePass, is_shared_graph
from specport.passes.quant.kv_calibration import calibrate_kv_scales
from specport.passes.quant.kv_select import choose_for_artifact

logger = logging.getLogger(__name__)

KV_DTYPES = ("float", "int8")
SHARED_DEFAULT_GRANULARITY = "per_channel"  # measured on SmolLM2-135M: see the README
_PAST = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")
_PRESENT = re.compile(r"^present\.(\d+)\.(key|value)$")


def default_kv_granularity(layout: str) -> str:
    """The scale granularity `quantize --kv-cache int8` uses on a layout (concat: per KV head,
    the QuantizeLinear axis; shared: see passes/quant/kv_cache_shared.py)."""
    return SHARED_DEFAULT_GRANULARITY if layout == "shared" else "per_kv_head"


def quantize_int8(x: np.ndarray, scale: np.ndarray, axis: int = 1) -> np.ndarray:
    """Reference QuantizeLinear (symmetric int8, round half to even, saturating)."""
    s = _expand(scale, x.ndim, axis)
    return np.clip(np.rint(x / s), -128, 127).astype(np.int8)


def dequantize_int8(q: np.ndarray, scale: np.ndarray, axis: int = 1) -> np.ndarray:
    """Reference DequantizeLinear with zero point 0."""
    return (q.astype(np.float32) * _expand(scale, q.ndim, axis)).astype(np.float32)


def _expand(scale: np.ndarray, ndim: int, axis: int) -> np.ndarray:
    shape = [1] * ndim
    shape[axis] = -1
    return np.asarray(scale, np.float32).reshape(shape)


# -- the pass -----------------------------------------------------------------------------


class QuantizeKVCachePass(Pass):
    """Make every past input and present output int8 (DequantizeLinear / QuantizeLinear)."""

    name = "quantize_kv_cache"

    def __init__(self, scales: dict[str, np.ndarray]) -> None:
        self.scales = scales  # present name -> [Hkv]

    def precondition(self, model: ir.Model) -> str | None:
        g = model.graph
        if is_shared_graph(model):
            return "shared KV layout: QuantizeSharedKVCachePass makes its in-place cache int8"
        pasts = [v for v in g.inputs if v.name and _PAST.match(v.name)]
        if not pasts:
            return "no past_key_values.* inputs"
        if any(v.dtype != ir.DataType.FLOAT for v in pasts):
            return "past_key_values.* inputs are not float32 (already quantized?)"
        return None

    def rewrite(self, model: ir.Model) -> tuple[bool, dict[str, Any]]:
        g = model.graph
        first = next(iter(g))
        self._cache: dict[str, tuple[ir.Value, ir.Value]] = {}
        layers: dict[str, Any] = {}
        float_step: list[str] = []
        pasts: dict[str, tuple[ir.Value, ir.Value]] = {}  # present name -> (int8 past, dequantized)
        shortcuts = 0
        for idx, old in enumerate(list(g.inputs)):
            m = _PAST.match(old.name or "")
            if not m:
                continue
            present = f"present.{m[1]}.{m[2]}"
            scale = self._scale(present, old)
            sv, zv = self._params(g, m[1], m[2], scale)
            new = ir.Value(name=old.name, shape=old.shape, type=ir.TensorType(ir.DataType.INT8))
            old.name = f"{new.name}/float"
            dq = _dequantize(new, sv, zv, old, f"/model/layers.{m[1]}/kv_cache/{m[2]}")
            g.insert_before(first, dq)
            # Shape needs no dequantized data: keep it on the int8 input.
            for use in list(old.uses()):
                target = new if use.node.op_type == "Shape" else dq.outputs[0]
                use.node.replace_input_with(use.idx, target)
            g.inputs[idx] = new
            layers[present] = [round(float(s), 8) for s in scale]
            pasts[present] = (new, dq.outputs[0])
        fused = self._quantize_gqa_inputs(g, pasts)
        for idx, old in enumerate(list(g.outputs)):
            m = _PRESENT.match(old.name or "")
            if not m:
                continue
            name = m[0]
            sv, zv = self._params(g, m[1], m[2], self._scale(name, old))
            old.name = f"{name}/float"
            q = ir.node(
                "QuantizeLinear",
                [old, sv, zv],
                attributes={"axis": 1},
                name=f"/model/layers.{m[1]}/kv_cache/{m[2]}/QuantizeLinear",
            )
            new_nodes = [q]
            new_part = _concat_after(old.producer(), pasts.get(name), g)
            if new_part is not None:
                # present = Concat(dequant(past), new): as int8 it is Concat(past, quant(new))
                # (quant(dequant(past)) is past), which skips requantizing the whole cache.
                q.replace_input_with(0, new_part)
                q.outputs[0].name = f"/model/layers.{m[1]}/kv_cache/{m[2]}/new_int8"
                cat = ir.node("Concat", [pasts[name][0], q.outputs[0]], attributes={"axis": 2})
                cat.name = f"/model/layers.{m[1]}/kv_cache/{m[2]}/Concat"
                new_nodes.append(cat)
                shortcuts += 1
            out = new_nodes[-1].outputs[0]
            out.name, out.shape, out.type = name, old.shape, ir.TensorType(ir.DataType.INT8)
            readers = [u for u in old.uses() if u.node is not q]
            if readers:  # attention reads the concatenated cache: give it the int8 values
                dq = _dequantize(out, sv, zv, old, f"/model/layers.{m[1]}/kv_cache/{m[2]}/present")
                for use in readers:
                    use.node.replace_input_with(use.idx, dq.outputs[0])
                new_nodes.append(dq)
            elif name not in fused:
                float_step.append(name)
            producer = old.producer()
            if producer is not None and producer.graph is g:
                g.insert_after(producer, new_nodes)
            else:
                g.extend(new_nodes)
            g.outputs[idx] = out
        if len(layers) != sum(1 for v in g.outputs if _PRESENT.match(v.name or "")):
            raise QuantizationError("past inputs and present outputs of the graph do not pair up")
        if shortcuts:
            remove_unused(model)  # the float concatenations and their dequantized pasts
        return True, {
            "dtype": "int8",
            "axis": 1,
            "symmetric": True,
            # int8: attention reads every position, the new ones too, through int8, so a
            # token's logits do not depend on how the sequence was split into runs;
            # float: an attention the pass cannot reach reads the new positions in float.
            "current_step": "float" if float_step else "int8",
            "float_step_tensors": float_step,
            "int8_concat": shortcuts,
            "gqa_int8_inputs": len(fused),
            "scales": layers,
        }

    def _quantize_gqa_inputs(
        self, g: ir.Graph, pasts: dict[str, tuple[ir.Value, ir.Value]]
    ) -> set[str]:
        """Fused attention: round-trip the new keys/values of com.microsoft GroupQueryAttention
        (key/value [B, S, Hkv*D], read with the dequantized past) through int8 before they
        reach it, so it attends to the same values later steps read from the cache. The new
        values are main-graph tensors, so a subgraph reading them gets the same. Returns the present names whose new positions are now int8."""
        done: set[str] = set()
        by_past = {dq: name for name, (_, dq) in pasts.items()}
        seen: dict[ir.Value, ir.Value] = {}
        for node in list(ir.traversal.RecursiveGraphIterator(g)):
            if node.op_type != "GroupQueryAttention" or node.domain != "com.microsoft":
                continue
            for new_idx, past_idx in ((1, 3), (2, 4)):
                if len(node.inputs) <= past_idx:
                    continue
                name = by_past.get(node.inputs[past_idx])  # type: ignore[arg-type]
                x = node.inputs[new_idx]
                producer = x.producer() if x is not None else None
                if name is None or x is None or producer is None or producer.graph is not g:
                    continue
                if x not in seen:
                    seen[x] = self._qdq_packed(g, x, producer, name)
                node.replace_input_with(new_idx, seen[x])
                done.add(name)
        return done

    def _qdq_packed(self, g: ir.Graph, x: ir.Value, producer: ir.Node, present: str) -> ir.Value:
        """x [B, S, Hkv*D] -> Reshape [B, S, Hkv, D] -> Q -> DQ (axis 2) -> Reshape back;
        every other reader of x is moved to the result too."""
        m = _PRESENT.match(present)
        assert m is not None
        scale = self._scale(present, x)
        sv, zv = self._params(g, m[1], m[2], scale)
        base = f"/model/layers.{m[1]}/kv_cache/{m[2]}/new"
        heads = add_initializer(g, f"{base}/heads_shape", np.array([0, 0, len(scale), -1]))
        flat = add_initializer(g, f"{base}/flat_shape", np.array([0, 0, -1]))
        r1 = ir.node("Reshape", [x, heads], name=f"{base}/Reshape")
        q = ir.node("QuantizeLinear", [r1.outputs[0], sv, zv], {"axis": 2}, name=f"{base}/Q")
        dq = ir.node("DequantizeLinear", [q.outputs[0], sv, zv], {"axis": 2}, name=f"{base}/DQ")
        r2 = ir.node("Reshape", [dq.outputs[0], flat], name=f"{base}/ReshapeBack")
        nodes = [named(n) for n in (r1, q, dq, r2)]
        out = r2.outputs[0]
        out.shape, out.type = x.shape, x.type
        for use in list(x.uses()):
            if use.node is not r1:
                use.node.replace_input_with(use.idx, out)
        g.insert_after(producer, nodes)
        return out

    def _scale(self, present: str, past: ir.Value) -> np.ndarray:
        if present not in self.scales:
            raise QuantizationError(f"no calibrated KV scale for {present}")
        scale = np.asarray(self.scales[present], np.float32)
        heads = past.shape[1] if past.shape is not None and past.shape.rank() == 4 else None
        if isinstance(heads, int) and scale.shape != (heads,):
            raise QuantizationError(
                f"KV scale of {present} has shape {scale.shape}, the graph has {heads} KV heads"
            )
        return scale

    def _params(
        self, g: ir.Graph, layer: str, kind: str, scale: np.ndarray
    ) -> tuple[ir.Value, ir.Value]:
        key = f"/model/layers.{layer}/kv_cache/{kind}"
        if key not in self._cache:
            sv = add_initializer(g, f"{key}/scale", np.asarray(scale, np.float32))
            zv = add_initializer(g, f"{key}/zero_point", np.zeros(scale.shape, np.int8))
            self._cache[key] = (sv, zv)
        return self._cache[key]


def _concat_after(
    producer: ir.Node | None, past: tuple[ir.Value, ir.Value] | None, g: ir.Graph
) -> ir.Value | None:
    """The new part S of `present = Concat(dequantized past, S, axis=2)`, else None."""
    if producer is None or past is None or producer.graph is not g:
        return None
    if producer.op_type != "Concat" or producer.domain not in ("", "ai.onnx"):
        return None
    axis = producer.attributes.get("axis")
    if axis is None or axis.value not in (2, -2) or len(producer.inputs) != 2:
        return None
    if producer.inputs[0] is not past[1]:
        return None
    return producer.inputs[1]


def int8_kv_manifest(manifest: Manifest, report: dict[str, Any], recipe: dict[str, Any]) -> None:
    """Record int8 KV in the manifest: kv.dtype, the past/present io dtypes, quant.kv_cache."""
    manifest.kv.dtype = "int8"
    kept = {int(i) for i in report.get("float_layers") or ()}
    if kept:  # some layers keep a float32 cache: the runtime allocates each in its own dtype
        layers = range(len(manifest.kv.num_heads))
        manifest.kv.layer_dtypes = ["float32" if i in kept else "int8" for i in layers]
    for entry in [*manifest.io.get("inputs", []), *manifest.io.get("outputs", [])]:
        m = _PAST.match(entry.get("name", "")) or _PRESENT.match(entry.get("name", ""))
        if m and int(m[1]) not in kept:
            entry["dtype"] = "int8"
    manifest.quant = dict(manifest.quant or {})
    manifest.quant["kv_cache"] = {
        **recipe,
        "current_step": report.get("current_step"),
        "scales": report.get("scales", {}),
    }


def kv_bytes_per_token(manifest: Manifest) -> int:
    """Bytes of KV cache one position adds (all layers, key and value) at the manifest dtype."""
    kv = manifest.kv
    return sum(
        h * (kd + vd) * np.dtype(dt).itemsize
        for h, kd, vd, dt in zip(kv.num_heads, kv.key_dim, kv.value_dim, kv.dtypes())
    )


def apply_int8_kv(
    model: ir.Model,
    model_path: Path | None,
    manifest: Manifest,
    src: Path,
    calib_files: Sequence[str | os.PathLike[str]],
    max_docs: int = 300,
    clip: str = "absmax",
    progress: Callable[[str, int, int], None] | None = None,
    granularity: str | None = None,
    float_layers: Sequence[int] | str = (),
) -> dict[str, Any]:
    """Calibrate KV scales on `model` as it is now and make its KV cache int8; the pass report.

    `model_path` is a saved copy of `model` when there is one (the untouched fp32 artifact);
    otherwise the model is saved to a temporary file first. Calibrating after the weight passes
    measures the keys/values the quantized graph really produces (see the module docstring).
    A shared-layout graph gets its int8 cache inside GroupQueryAttention
    (passes/quant/kv_cache_shared.py); `granularity` None picks the layout's default.
    `float_layers` (shared layout only) keep a float32 cache; "auto" measures which
    (passes/quant/kv_select.py).
    """
    shared = is_shared_graph(model)
    if float_layers and not shared:
        raise QuantizationError(
            "--kv-float-layers needs the shared KV layout (its attention nodes take a bit width "
            "each); quantize a shared-layout export"
        )
    granularity = granularity or default_kv_granularity("shared" if shared else "concat")
    cb = (lambda i, n: progress("calibrate kv", i, n)) if progress else None
    with tempfile.TemporaryDirectory(prefix="specport-kv-") as tmp:
        if model_path is None:
            model_path = Path(tmp) / "model.onnx"
            ir.save(model, model_path, external_data="model.onnx.data")
        scales = calibrate_kv_scales(
            model_path, manifest, src, calib_files, max_docs, clip, cb, granularity
        )
        choice = None
        if float_layers == "auto":
            float_layers, choice = choose_for_artifact(
                model_path, manifest, src, calib_files, scales, granularity, progress
            )
    kept_float = () if isinstance(float_layers, str) else float_layers  # "auto": resolved above
    kv_pass: Pass = (
        QuantizeSharedKVCachePass(scales, granularity, kept_float)
        if shared
        else QuantizeKVCachePass(scales)
    )
    result = kv_pass(model)
    if not result.modified:
        raise QuantizationError(f"int8 KV cache not applied: {result.report.get('skipped')}")
    if choice is not None:
        result.report["float_layer_choice"] = choice
    return result.report


def _dequantize(
    q: ir.Value, scale: ir.Value, zero: ir.Value, like: ir.Value, prefix: str
) -> ir.Node:
    """DequantizeLinear over KV heads (axis 1) whose output has ``like``'s float shape and type."""
    dq = named(
        ir.node(
            "DequantizeLinear",
            [q, scale, zero],
            attributes={"axis": 1},
            name=f"{prefix}/DequantizeLinear",
        )
    )
    dq.outputs[0].shape, dq.outputs[0].type = like.shape, like.type
    return dq
