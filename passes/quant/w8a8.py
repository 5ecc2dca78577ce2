"""W8A8: int8 weights, int8 activations, SmoothQuant migration folded into the weights.

Three graph forms of the same smoothed weights (`form`):

- `matmulnbits` (default): com.microsoft.MatMulNBits bits=8, accuracy_level=4, blockwise
  asymmetric int8 weights (block `group_size` along K, default 64); the kernel quantizes the
  activations to int8 per row and block at run time (dynamic, symmetric) and runs integer dot
  products. Blocks of at most 64 keep that kernel row-invariant (a token computes the same in
  a one-token step and a verify run: quant/row_invariance.py); 128 does not.
  Fastest on onnxruntime's CPU provider (AVX512-VNNI/AMX), and needs no activation ranges.
- `dynamic`: com.microsoft.DynamicQuantizeMatMul (what onnxruntime's quantize_dynamic emits
  after fusion): uint8 per-channel weights with a zero point, uint8 per-tensor activations
  computed per run (not row-invariant: speculation on it is not token-exact).
- `qdq`: static per-tensor uint8 activations from the calibration ranges, in QDQ form
  (portable; onnxruntime fuses it into MatMulIntegerToFloat).
- `ascend`: the layout of Ascend's own W8A8 (msModelSlim's `weight`, `deq_scale`,
  `input_scale`, `input_offset`): symmetric int8 weights per output channel (no weight
  offset), int8 activations with one scale and one offset per tensor, the LM head in the same
  form; standard ops only (QuantizeLinear / DequantizeLinear / MatMul), no com.microsoft op,
  so a `cann` artifact stays runnable by the CANN provider. SmoothQuant folded into the
  norm scales is what Ascend's anti-outlier step does too.

The QDQ form in detail:

For each activation x feeding one or more weight MatMuls (q/k/v share the attention norm
output, gate/up share the MLP norm output):

1. SmoothQuant: choose alpha on calibration rows (or no smoothing when it does not help);
   s [K] is shared by every consumer. x / s is folded into the weights that make x, so it
   costs nothing at run time: into the RMSNormalization scale when x comes straight from a
   norm whose every user is one of these MatMuls; into the up projection's columns when x is
   SwiGLU's silu(gate) * up; into the value columns of the attention's QKV projection when x
   is GroupQueryAttention's output (s tied over the query heads that share a KV head, since
   they read the same values). Only where none of these holds is an explicit Mul(x, 1/s)
   inserted (SmolLM2-135M: 60 folded into norms, 60 into producers, none explicit; the 60
   Muls this removes were 4-10% of a W8A8 decode step).
2. x' -> QuantizeLinear -> DequantizeLinear (uint8, range from calibration min/max of x / s).
3. W' = diag(s) W -> uint8 per output channel with a zero point -> DequantizeLinear(axis=1)
   -> MatMul. uint8, not int8, weights in the `dynamic` and `qdq` forms: onnxruntime's
   uint8 x int8 kernels saturate int16 sums on AVX2 CPUs without VNNI (wrong results, see
   smoothquant.py); uint8 x uint8 is exact on every CPU.

onnxruntime's QDQ transformer fuses DQ->MatMul<-DQ into MatMulIntegerToFloat (or QLinearMatMul
when the output is quantized too), so the integer kernels run; the pass does not depend on it.
The LM head is an 8-bit MatMulNBits with accuracy_level 4 (int8 activations) in every form,
unless `lm_head_bits` is 0 (kept float) or 4.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import onnx_ir as ir

from specport.core.errors import QuantizationError
from specport.core.progress import track
from specport.passes.base import Pass
from specport.passes.quant import smoothquant as SQ
from specport.passes.quant.blockquant import BlockQuant
from specport.passes.quant.calibration import ActStats
from specport.passes.quant.graph import (
    WeightSite,
    add_initializer,
    find_weight_matmuls,
    named,
    remove_unused,
    replace_node,
)
from specport.passes.quant.rtn import quantize_rtn
from specport.passes.quant.weight_only import QuantizeWeightsNBitsPass

logger = logging.getLogger(__name__)

# Norm op -> index of its scale (gamma) input.
NORM_OPS = {
    "RMSNormalization": 1,
    "SimplifiedLayerNormalization": 1,
    "SkipSimplifiedLayerNormalization": 2,
}
FORMS = ("matmulnbits", "dynamic", "qdq", "ascend")
QDQ_FORMS = ("qdq", "ascend")  # static activation ranges, standard ops


def _norm_scale(x: ir.Value, sites: list[WeightSite]) -> tuple[ir.Node, int] | None:
    """(norm node, index of its scale input) when x = Norm(h, scale) can absorb 1/s, else None."""
    prod = x.producer()
    if prod is None or prod.op_type not in NORM_OPS or prod.outputs[0] is not x:
        return None
    consumers = {id(u) for u, _ in x.uses()}
    if consumers != {id(s.node) for s in sites} or x.is_graph_output():
        return None
    idx = NORM_OPS[prod.op_type]
    scale = prod.inputs[idx] if len(prod.inputs) > idx else None
    if scale is None or scale.const_value is None or not scale.is_initializer():
        return None
    return prod, idx


def _fold_into_norm(graph: ir.Graph, norm: ir.Node, idx: int, s: np.ndarray) -> None:
    """gamma <- gamma / s; a scale shared with other norms (exporters deduplicate equal
    initializers) gets a private copy first."""
    scale = norm.inputs[idx]
    assert scale is not None and scale.const_value is not None
    gamma = scale.const_value.numpy().astype(np.float32) / s
    if len(list(scale.uses())) == 1:
        scale.const_value = ir.tensor(gamma, name=scale.name)
    else:
        norm.replace_input_with(idx, add_initializer(graph, f"{scale.name}.smoothed", gamma))


@dataclasses.dataclass
class _Producer:
    """Where x / s can be folded: x's channel j scales with column `columns[j]` of `weight`
    (and of `bias`), the weight that makes x's linear factor. `tie` makes s equal on
    channels that share a column. `cached`: the columns are the attention's values, which the
    KV cache holds, so a fold changes what the cache holds."""

    weight: ir.Value
    bias: ir.Value | None
    columns: np.ndarray
    tie: Callable[[np.ndarray], np.ndarray] | None = None
    cached: bool = False


def _linear_producer(x: ir.Value, sites: list[WeightSite]) -> _Producer | None:
    """The columns that x / s can be folded into, or None (then a Mul divides at run time).

    - x = Mul(a, u), u columns of a MatMul (SwiGLU's silu(gate) * up: the up projection's
      columns take the down projection's smoothing);
    - x = GroupQueryAttention's output: the attention output of query head h is a weighted
      sum of the values of KV head h // G, so the value columns take the smoothing of the
      output projection, tied over the G query heads that share each KV head.
    """
    node = x.producer()
    if node is None or x.is_graph_output():
        return None
    if {id(u) for u, _ in x.uses()} != {id(s.node) for s in sites}:
        return None
    width = sites[0].k
    if node.op_type == "Mul" and len(node.inputs) == 2 and node.inputs[0] is not node.inputs[1]:
        for factor in node.inputs:
            if factor is None:
                continue
            found = _weight_columns(factor, node, width, shape_users=False)
            if found is not None:
                weight, bias, start = found
                return _Producer(weight, bias, np.arange(start, start + width))
        return None
    if node.op_type == "GroupQueryAttention" and node.domain == "com.microsoft":
        if node.outputs[0] is not x:
            return None
        heads = node.attributes.get_int("num_heads", 0)
        kv_heads = node.attributes.get_int("kv_num_heads", 0)
        if not heads or not kv_heads or heads % kv_heads or width % heads:
            return None
        dim, group = width // heads, heads // kv_heads
        packed = len(node.inputs) < 3 or node.inputs[2] is None
        source = node.inputs[0] if packed else node.inputs[2]
        if source is None:
            return None
        columns_of = (heads + 2 * kv_heads) * dim if packed else kv_heads * dim
        found = _weight_columns(source, node, columns_of, shape_users=True)
        if found is None:
            return None
        weight, bias, start = found
        offset = start + ((heads + kv_heads) * dim if packed else 0)
        head = np.arange(heads).repeat(dim)
        columns = offset + (head // group) * dim + np.tile(np.arange(dim), heads)

        def tie(v: np.ndarray) -> np.ndarray:
            m = v.reshape(kv_heads, group, dim).max(axis=1, keepdims=True)
            return np.repeat(m, group, axis=1).reshape(-1)

        return _Producer(weight, bias, columns, tie, cached=True)
    return None


def _weight_columns(
    value: ir.Value, consumer: ir.Node, width: int, shape_users: bool
) -> tuple[ir.Value, ir.Value | None, int] | None:
    """(W, bias or None, first column) when `value` (read by `consumer`) is `width` columns of
    MatMul(h, W) (+ a constant bias), directly or as one output of a Split along the last
    axis; W and every value on the way have no other user (`shape_users`: except Shape nodes,
    which read no values)."""

    def only_user(v: ir.Value, user: ir.Node) -> bool:
        others = [u for u, _ in v.uses() if u is not user]
        return not v.is_graph_output() and all(shape_users and u.op_type == "Shape" for u in others)

    if not only_user(value, consumer):
        return None
    node, start = value.producer(), 0
    if node is not None and node.op_type == "Split":
        source = node.inputs[0]
        axis = node.attributes.get_int("axis", 0)
        rank = len(source.shape) if source is not None and source.shape is not None else None
        if source is None or (axis != -1 and (rank is None or axis != rank - 1)):
            return None
        if not only_user(source, node):
            return None
        index = list(node.outputs).index(value)
        sizes_input = node.inputs[1] if len(node.inputs) > 1 else None
        if sizes_input is not None:
            if sizes_input.const_value is None:
                return None
            sizes = [int(v) for v in sizes_input.const_value.numpy().reshape(-1)]
        else:
            sizes = [width] * len(node.outputs)  # an equal split: each output is `width` wide
        if sizes[index] != width:
            return None
        start, node, value = sum(sizes[:index]), source.producer(), source
    bias = None
    if node is not None and node.op_type == "Add" and len(node.inputs) == 2:
        consts = [v for v in node.inputs if v is not None and v.const_value is not None]
        others = [v for v in node.inputs if v is not None and v.const_value is None]
        if len(consts) != 1 or len(others) != 1:
            return None
        bias_value = consts[0].const_value
        if bias_value is None or len(bias_value.shape) != 1:
            return None
        if len(consts[0].uses()) != 1 or not only_user(others[0], node):
            return None
        bias, node = consts[0], others[0].producer()
    if node is None or node.op_type != "MatMul" or len(node.inputs) != 2:
        return None
    weight = node.inputs[1]
    if weight is None or weight.const_value is None or not weight.is_initializer():
        return None
    shape = weight.const_value.shape
    if len(shape) != 2 or not isinstance(shape[1], int) or len(weight.uses()) != 1:
        return None
    return (weight, bias, start) if start + width <= shape[1] else None


def _fold_into_columns(producer: _Producer, weight: np.ndarray, s: np.ndarray) -> np.ndarray:
    """The producer's weight [K, N] with w[:, c] / s_j for each channel j of x and its column c
    (tied channels share c and s), a copy (the array read may be the initializer's own); the
    bias is divided in place."""
    columns, first = np.unique(producer.columns, return_index=True)
    scale = s[first]
    folded = weight.copy()
    folded[:, columns] /= scale
    bias = producer.bias
    if bias is not None:
        assert bias.const_value is not None
        array = bias.const_value.numpy().astype(np.float32).copy()
        array[columns] /= scale
        bias.const_value = ir.tensor(array, name=bias.name)
    return folded


@dataclasses.dataclass
class _GroupPlan:
    """One activation's smoothing and its weights [K, N] (read once, held until quantized)."""

    xname: str
    sites: list[WeightSite]
    x: ir.Value
    weights: list[np.ndarray]
    alpha: float | None = None
    s: np.ndarray | None = None
    err: float | None = None
    how: str = "none"


def _fold_targets(
    order: list[tuple[str, list[WeightSite]]],
) -> list[tuple[tuple[ir.Node, int] | None, _Producer | None, tuple[int, int] | None]]:
    """Per group, from the graph alone (no weights read): the norm that can absorb x / s,
    else the producer whose columns can, and that producer's weight as (earlier group, site
    index) when it is one of the weights being quantized (else the fold is not taken)."""
    owners = {
        id(site.weight): (g, k)
        for g, (_, sites) in enumerate(order)
        for k, site in enumerate(sites)
    }
    found: list[tuple[tuple[ir.Node, int] | None, _Producer | None, tuple[int, int] | None]] = []
    for i, (_, sites) in enumerate(order):
        norm = _norm_scale(sites[0].x, sites)
        producer = None if norm is not None else _linear_producer(sites[0].x, sites)
        target = owners.get(id(producer.weight)) if producer is not None else None
        if target is not None and target[0] >= i:  # not made before x: cannot happen in a DAG
            target = None
        found.append((norm, producer if target is not None else None, target))
    return found


class QuantizeW8A8Pass(Pass):
    """Static W8A8 with SmoothQuant; needs calibration statistics per MatMul input."""

    name = "quantize_w8a8"

    def __init__(
        self,
        stats: Mapping[str, ActStats] | None,
        smooth: bool = True,
        lm_head_bits: int = 8,
        group_size: int = 64,
        alphas: tuple[float, ...] = (0.0, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8),
        form: str = "matmulnbits",
        keep_kv_values: bool = False,
    ) -> None:
        """`stats` None (no calibration text): round-to-nearest without SmoothQuant, in the
        `matmulnbits` form only (its kernel quantizes activations at run time; the other forms
        need static activation ranges). On a source whose weights lie on a 4-bit grid
        (SmolLM2's Q4_1 GGUF) 8-bit blocks of 32 hold every block within a 34th of its step.
        `keep_kv_values`: leave unsmoothed the activations whose smoothing could only go
        into the value projection (the attention output), so the KV cache holds the float
        model's values; a draft that drafts in its float target's cache needs that
        (runtime/speculative/draft.py). Costs no run time (no Mul); those projections are
        quantized without SmoothQuant."""
        if form not in FORMS:
            raise QuantizationError(f"unknown W8A8 form {form!r}; choose one of {', '.join(FORMS)}")
        if stats is None and form != "matmulnbits":
            raise QuantizationError(
                f"the {form} W8A8 form needs calibration text (static activation ranges)"
            )
        smooth = smooth and stats is not None
        self.stats, self.smooth, self.lm_head_bits = stats, smooth, lm_head_bits
        self.keep_kv_values = keep_kv_values
        self.group_size, self.alphas, self.form = group_size, alphas, form
        # Emits MatMulNBits nodes (the int8-activation body in `matmulnbits` form, and the head).
        self._nbits = QuantizeWeightsNBitsPass(8, group_size, "rtn", accuracy_level=4)

    def precondition(self, model: ir.Model) -> str | None:
        sites = [s for s in find_weight_matmuls(model) if not s.lm_head]
        if not sites:
            return "no MatMul with a constant weight"
        if self.stats is None:
            return None  # round-to-nearest, no smoothing: nothing to measure
        missing = [s.x.name for s in sites if s.x.name not in self.stats]
        return f"no calibration statistics for {missing[:3]}" if missing else None

    def rewrite(self, model: ir.Model) -> tuple[bool, dict[str, Any]]:
        graph = model.graph
        groups: dict[str, list[WeightSite]] = {}
        heads: list[WeightSite] = []
        for site in find_weight_matmuls(model):
            if site.lm_head:
                heads.append(site)
            else:
                groups.setdefault(site.x.name or "", []).append(site)
        layers: dict[str, Any] = {}
        counts = {"folded into norm": 0, "folded into producer": 0, "explicit Mul": 0}
        into_values = kept_values = 0
        packed_groups = 0
        order = list(groups.items())
        folds = _fold_targets(order)
        # A group's weights wait (read once, in memory) until every later group that folds
        # its smoothing into their columns has chosen it: at most a layer's projections
        # (QKV until the output projection, gate/up until the down projection).
        last_fold = list(range(len(order)))
        for i, (_, _, target) in enumerate(folds):
            if target is not None:
                last_fold[target[0]] = max(last_fold[target[0]], i)
        pending: dict[int, _GroupPlan] = {}
        for i, (xname, sites) in enumerate(track(order, "quantizing weights (w8a8)")):
            norm, producer, target = folds[i]
            plan = _GroupPlan(xname, sites, sites[0].x, [site.weight_array() for site in sites])
            keeps_values = (
                self.keep_kv_values and norm is None and producer is not None and producer.cached
            )
            kept_values += keeps_values
            if self.smooth and not keeps_values:
                assert self.stats is not None  # smooth is off without statistics
                plan.alpha, plan.s, plan.err = SQ.search_smoothquant(
                    self.stats[xname].rows_sample(),
                    plan.weights,
                    self.stats[xname].absmax,
                    self.alphas,
                    tie=producer.tie if producer is not None else None,
                )
            if plan.s is not None:
                # x / s goes where it costs nothing at run time: into the norm that makes
                # x, or into the columns of the weight that makes x's linear factor
                if norm is not None:
                    _fold_into_norm(graph, norm[0], norm[1], plan.s)
                    plan.how = "folded into norm"
                elif producer is not None and target is not None:
                    owner = pending[target[0]]
                    owner.weights[target[1]] = _fold_into_columns(
                        producer, owner.weights[target[1]], plan.s
                    )
                    plan.how = "folded into producer"
                    into_values += producer.cached
                else:
                    plan.x = self._divide(graph, xname, sites[0], plan.s)
                    plan.how = "explicit Mul"
                counts[plan.how] += 1
            pending[i] = plan
            for j in [j for j in pending if last_fold[j] <= i]:
                packed_groups += self._quantize_group(graph, pending.pop(j), layers)
        head_report: dict[str, Any] = {}
        if heads and self.lm_head_bits and self.form == "ascend":
            if self.lm_head_bits != 8:
                raise QuantizationError("the ascend W8A8 form keeps an 8-bit or float LM head")
            for head in heads:  # same layout as the body, no smoothing
                assert self.stats is not None  # the ascend form needs statistics (__init__)
                st = self.stats[head.x.name or ""]
                lo, hi = float(st.lo.min()), float(st.hi.max())
                xq = self._quantize_input(graph, head.x, head.x.name or "", head, lo, hi)
                self._emit(graph, head, xq, head.weight_array())
                layers[head.name] = {
                    "bits": 8,
                    "activation_bits": 8,
                    "form": self.form,
                    "lm_head": True,
                    "act_range": [round(lo, 6), round(hi, 6)],
                }
        elif heads and self.lm_head_bits:
            sub = QuantizeWeightsNBitsPass(
                8,
                self.group_size,
                "rtn",
                lm_head_bits=self.lm_head_bits,
                plan={h.name: self.lm_head_bits for h in heads},
                accuracy_level=4,
            )
            _, head_report = sub.rewrite(model)
            layers.update(head_report["layers"])
        remove_unused(model)
        if model.opset_imports.get("", 0) < 21:
            model.opset_imports[""] = 21
        uses_ms = any(n.domain == "com.microsoft" for n in graph)
        if uses_ms and model.opset_imports.get("com.microsoft", 0) < 1:
            model.opset_imports["com.microsoft"] = 1
        return bool(layers), {
            "form": self.form,
            "smoothing_folded": counts["folded into norm"],
            "smoothing_into_producer": counts["folded into producer"],
            "smoothing_explicit": counts["explicit Mul"],
            "smoothing_into_values": into_values,
            "unsmoothed_for_kv": kept_values,
            "packed_groups": packed_groups,
            "layers": layers,
        }

    def _divide(self, graph: ir.Graph, xname: str, first: WeightSite, s: np.ndarray) -> ir.Value:
        """x -> Mul(x, 1/s) before the group's first MatMul: the smoothing no weight absorbs."""
        inv = add_initializer(graph, f"{xname}.smooth_inv", (1.0 / s).astype(np.float32))
        mul = ir.node("Mul", [first.x, inv], name=f"{first.name}/SmoothQuantMul")
        graph.insert_before(first.node, named(mul))
        mul.outputs[0].name = f"{xname}.smoothed"
        return mul.outputs[0]

    def _quantize_group(self, graph: ir.Graph, plan: _GroupPlan, layers: dict[str, Any]) -> int:
        """Quantize one activation's weights (their folded columns already scaled) and
        replace its MatMuls; returns the packed groups emitted."""
        s, sites, x = plan.s, plan.sites, plan.x
        lo = hi = float("nan")  # no calibration: the kernel quantizes x at run time
        if self.stats is not None:
            st = self.stats[plan.xname]
            if s is not None:
                lo, hi = float(np.min(st.lo / s)), float(np.max(st.hi / s))
            else:
                lo, hi = float(st.lo.min()), float(st.hi.max())
        xq = self._quantize_input(graph, x, plan.xname, sites[0], lo, hi)
        packed: list[tuple[WeightSite, BlockQuant]] = []
        for site, w in zip(sites, plan.weights):
            ws = w if s is None else w * s[:, None]
            if self.form == "matmulnbits":  # siblings packed into one MatMulNBits
                bq = quantize_rtn(ws, 8, self.group_size, symmetric=False)
                packed.append((dataclasses.replace(site, x=x), bq))
            else:
                self._emit(graph, dataclasses.replace(site, x=x), xq, ws)
            layers[site.name] = {
                "bits": 8,
                "activation_bits": 8,
                "form": self.form,
                "smooth_alpha": plan.alpha,
                "smoothing": plan.how,
                "act_range": None if self.stats is None else [round(lo, 6), round(hi, 6)],
                "sample_rel_error": None if plan.err is None else round(plan.err / len(sites), 8),
            }
        plan.weights = []  # released as soon as they are quantized
        return self._nbits.emit_nbits_groups(graph, packed)

    def _quantize_input(
        self, graph: ir.Graph, x: ir.Value, xname: str, first: WeightSite, lo: float, hi: float
    ) -> ir.Value:
        """QDQ forms: x -> QuantizeLinear -> DequantizeLinear with the static range [lo, hi]
        (uint8, or int8 with an offset for ascend); the dynamic forms quantize inside the
        kernel and take x as it is."""
        if self.form not in QDQ_FORMS:
            return x
        sa, za = SQ.quantize_activation_uint8(lo, hi)
        zero = np.array(za, dtype=np.uint8)
        if self.form == "ascend":  # the same grid shifted by 128: int8 codes, offset in int8
            zero = np.array(int(za) - 128, dtype=np.int8)
        sv = add_initializer(graph, f"{xname}.act_scale", np.array(sa, dtype=np.float32))
        zv = add_initializer(graph, f"{xname}.act_zero", zero)
        ql = ir.node("QuantizeLinear", [x, sv, zv], name=f"{first.name}/QuantizeLinear")
        dql = ir.node(
            "DequantizeLinear", [ql.outputs[0], sv, zv], name=f"{first.name}/DequantizeLinear"
        )
        graph.insert_before(first.node, [named(ql), named(dql)])
        return dql.outputs[0]

    def _emit(self, graph: ir.Graph, site: WeightSite, xq: ir.Value, ws: np.ndarray) -> None:
        """Replace site's MatMul by the dynamic or QDQ int8 op on the smoothed weight ws [K, N].

        onnxruntime forms store uint8 weights with a zero point per channel: onnxruntime's
        uint8 x int8 kernels saturate on AVX2 CPUs without VNNI (see smoothquant's docstring),
        its uint8 x uint8 kernels are exact everywhere. Ascend's layout is symmetric int8.
        """
        if self.form == "ascend":
            q, sw = SQ.quantize_int8_per_channel(ws)
            zw: np.ndarray | None = None
        else:
            q, sw, zw = SQ.quantize_uint8_per_channel(ws)
        inputs = [
            add_initializer(graph, f"{site.name}.w8", q),
            add_initializer(graph, f"{site.name}.w8_scale", sw),
        ]
        if zw is not None:
            inputs.append(add_initializer(graph, f"{site.name}.w8_zero", zw))
        if self.form == "dynamic":
            node = ir.node(
                "DynamicQuantizeMatMul",
                [site.x, *inputs],
                domain="com.microsoft",
                name=f"{site.name}/DynamicQuantizeMatMul",
            )
            replace_node(graph, site.node, [node], node.outputs[0])
            return
        dqw = ir.node(
            "DequantizeLinear", inputs, {"axis": 1}, name=f"{site.name}/DequantizeLinearW"
        )
        mm = ir.node("MatMul", [xq, dqw.outputs[0]], name=f"{site.name}/MatMul")
        replace_node(graph, site.node, [dqw, mm], mm.outputs[0])


def kv_values_of(reports: list[dict[str, Any]]) -> str:
    """What a quantized artifact's KV cache holds, for the manifest's `quant.kv_values`:
    "smoothed" when a W8A8 pass folded SmoothQuant scales into the value projection (the
    cached values are the source's divided by them), else "source"."""
    folded = sum(
        int(r.get("smoothing_into_values", 0)) for r in reports if r.get("name") == "quantize_w8a8"
    )
    return "smoothed" if folded else "source"
