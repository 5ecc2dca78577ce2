"""Fuse attention over a concatenated KV cache into specport.GroupQueryAttention.

Matches what `torch.onnx.export(dynamo=True, opset_version=23)` emits for HF decoder attention:

    present_k = Concat(past_key [B, Hkv, P, Dh], k_new [B, Hkv, S, Dh], axis=2)   (graph output)
    k_rep     = Reshape(Expand(Unsqueeze(present_k, 2)))  [B, H, T, Dh]     (GQA/MQA only)
    y         = Attention-23(q [B, H, S, Dh], k_rep, v_rep, mask)          [B, H, S, Dv]

and rewrites it to one node that takes the spine's `attention_mask` [B, P+S] directly
(causal + padding + optional sliding window are computed inside). The graph's inputs and
outputs do not change (present.{i}.* keep their names), so the runtime needs no change.

When a sliding-window cache layer crops the past before the Concat (HF's
DynamicSlidingWindowLayer keeps the last W-1 tokens), the fused op takes the cropped past and the
matching last columns of the mask, so present keeps the exported (cropped) length.

Attention-23's `softcap` (Gemma 2) is carried over to the fused op.
What is not matched, with the reason in the report: 3-D packed Q/K/V,
attention whose K/V are not a 2-input Concat of a past (no KV cache / other cache layouts),
unknown head counts. The sliding window comes from the pass option `sliding_window` (int, or a
list per attention node in graph order), else the model metadata key `sliding_window`, else the
exported mask itself (HF's `kv_idx > q_idx - W` term, see `detect_window`).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass, TopologicalSortPass

from specport.custom_ops import DOMAIN
from specport.passes.base import Pass
from specport.passes.fuse_sdpa import fuse_sdpa

logger = logging.getLogger(__name__)

MASK_INPUT = "attention_mask"
PAST_PREFIX = "past_key_values."
# _match's answer for latent-cache (MLA) attention: fused already, nothing to rewrite.
LATENT = "latent"
# _match's answer for attention without a KV cache: Attention-23 already is one fused node.
NO_CACHE = "K/V are not Concat(past, new, axis=2) and do not come from a KV-cache input"


def _reaches_past_input(v: ir.Value | None, depth: int = 16) -> bool:
    """True when `v` is computed from a KV-cache graph input within `depth` producer steps."""
    frontier = [v]
    seen: set[int] = set()
    for _ in range(depth):
        nxt: list[ir.Value | None] = []
        for value in frontier:
            if value is None or id(value) in seen:
                continue
            seen.add(id(value))
            if value.name and value.name.startswith(PAST_PREFIX) and value.producer() is None:
                return True
            producer = value.producer()
            if producer is not None:
                nxt.extend(producer.inputs)
        frontier = nxt
        if not frontier:
            break
    return False


def _producer(v: ir.Value | None, op_type: str) -> ir.Node | None:
    if v is None:
        return None
    node = v.producer()
    return node if node is not None and node.op_type == op_type and node.domain == "" else None


def _unrepeat(v: ir.Value | None) -> ir.Value | None:
    """Undo the GQA head repeat Reshape(Expand(Unsqueeze(x, 2))) -> x; identity otherwise."""
    reshape = _producer(v, "Reshape")
    expand = _producer(reshape.inputs[0], "Expand") if reshape else None
    unsq = _producer(expand.inputs[0], "Unsqueeze") if expand else None
    if unsq is None:
        return v
    axes = unsq.inputs[1].const_value if len(unsq.inputs) > 1 and unsq.inputs[1] else None
    if axes is None or axes.numpy().reshape(-1).tolist() not in ([2], [-3]):
        return v
    return unsq.inputs[0]


def _concat_parts(v: ir.Value | None) -> tuple[ir.Node, ir.Value, ir.Value] | None:
    node = _producer(v, "Concat")
    if node is None or len(node.inputs) != 2:
        return None
    past, new = node.inputs
    if past is None or new is None:
        return None
    if node.attributes.get_int("axis", 0) not in (2, -2):
        return None
    return node, past, new


def detect_window(mask: ir.Value | None, limit: int = 400) -> int | None:
    """Find HF's sliding-window term `kv_idx > q_idx - W` in the exported mask subgraph.

    transformers' `sliding_window_overlay` exports as Greater(k, Sub(q, W)) with W a constant;
    returns W, or None when the mask has no such term (full causal attention).
    """
    seen: set[int] = set()
    stack = [mask]
    while stack and len(seen) < limit:
        v = stack.pop()
        node = v.producer() if v is not None else None
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if node.op_type == "Greater" and node.domain == "":
            sub = _producer(node.inputs[1], "Sub")
            c = sub.inputs[1].const_value if sub is not None and sub.inputs[1] is not None else None
            if c is not None and c.numpy().size == 1:
                return int(c.numpy().reshape(-1)[0])
        stack.extend(node.inputs)
    return None


def _crop_mask(mask: ir.Value, past: ir.Value, new: ir.Value) -> tuple[ir.Value, list[ir.Node]]:
    """mask[:, T - (P' + S):] where P' = past.shape[2] (after cropping), S = new.shape[2]."""
    tape = ir.tape.Tape()
    p_len = tape.op("Shape", [past], {"start": 2, "end": 3})
    s_len = tape.op("Shape", [new], {"start": 2, "end": 3})
    total = tape.op("Shape", [mask], {"start": 1, "end": 2})
    start = tape.op("Sub", [total, tape.op("Add", [p_len, s_len])])
    axes = tape.op("Constant", [], {"value": ir.tensor(np.asarray([1], np.int64))})
    cropped = tape.op("Slice", [mask, start, total, axes])
    return cropped, list(tape.nodes)


def _cropped(past: ir.Value) -> bool:
    """A past cropped to a window before the Concat (HF sliding-window cache layers): a Slice on
    the sequence axis. Other producers (Gather/Split of a stacked [2, B, H, P, D] past) keep
    every position."""
    node = _producer(past, "Slice")
    if node is None:
        return False
    axes = node.inputs[3].const_value if len(node.inputs) > 3 and node.inputs[3] else None
    return axes is not None and axes.numpy().reshape(-1).tolist() in ([2], [-2])


def _reaches_named_input(v: ir.Value | None, name: str, limit: int = 4000) -> bool:
    """True when the graph input called `name` is among the ancestors of `v`."""
    seen: set[int] = set()
    stack = [v]
    while stack and len(seen) < limit:
        value = stack.pop()
        if value is None or id(value) in seen:
            continue
        seen.add(id(value))
        node = value.producer()
        if node is None:
            if value.name == name:
                return True
            continue
        stack.extend(node.inputs)
        for attr in node.attributes.values():  # values an If/Loop body reads from outside
            if attr.type == ir.AttributeType.GRAPH:
                stack.extend(n_in for n in attr.value for n_in in n.inputs)
    return False


def _static(v: ir.Value, axis: int) -> int | None:
    if v.shape is None or v.shape.rank() != 4:
        return None
    d = v.shape[axis]
    return d if isinstance(d, int) else None


class FuseAttentionPass(Pass):
    """Attention-23 + concat KV cache -> specport.GroupQueryAttention (MHA/GQA/MQA)."""

    name = "fuse_attention"

    def __init__(self, sliding_window: int | list[int] | None = None) -> None:
        self.sliding_window = sliding_window

    def precondition(self, model: ir.Model) -> str | None:
        if not any(n.op_type in ("Attention", "Softmax") and n.domain == "" for n in model.graph):
            return "no attention: neither an ai.onnx Attention node nor a Softmax"
        return None

    def _window(self, model: ir.Model, index: int, node: ir.Node) -> tuple[int, str]:
        sw: Any = self.sliding_window
        source = "option"
        if sw is None and "sliding_window" in model.metadata_props:
            sw, source = model.metadata_props["sliding_window"], "metadata"
            sw = [int(x) for x in str(sw).split(",")] if "," in str(sw) else int(sw)
        if sw is None:
            found = detect_window(node.inputs[3] if len(node.inputs) > 3 else None)
            if found is not None:
                return found, "detected in the exported mask"
            return 0, "none (no window term in the mask, no option)"
        if isinstance(sw, list):
            return int(sw[index]) if index < len(sw) else 0, source
        return int(sw), source

    def _match(self, node: ir.Node) -> dict[str, Any] | str:
        if len(node.inputs) > 4 and any(v is not None for v in node.inputs[4:]):
            return "Attention already takes past_key/past_value inputs"
        if any(o.uses() or o.is_graph_output() for o in node.outputs[1:]):
            return "Attention present/qk outputs are used"
        q, k, v = node.inputs[0], node.inputs[1], node.inputs[2]
        if q is None or q.shape is None or q.shape.rank() != 4:
            return "query is not 4-D [B, H, S, Dh] (3-D packed form not supported)"
        kparts = _concat_parts(_unrepeat(k))
        vparts = _concat_parts(_unrepeat(v))
        if kparts is None or vparts is None:
            if _reaches_past_input(k) and _reaches_past_input(v):
                return LATENT
            return NO_CACHE
        k_cropped = _cropped(kparts[1])
        if k_cropped != _cropped(vparts[1]):
            return "past K and past V are transformed differently before the Concat"
        mask_in = node.inputs[3] if len(node.inputs) > 3 else None
        if mask_in is None and not node.attributes.get_int("is_causal", 0):
            return "no mask and not causal (bidirectional attention is not a decoder layer)"
        if mask_in is not None and not _reaches_named_input(mask_in, MASK_INPUT):
            return f"the mask is not computed from the '{MASK_INPUT}' input"
        num_heads = _static(q, 1)
        kv_heads = _static(kparts[1], 1)
        head_dim = _static(q, 3)
        if not num_heads or not kv_heads or num_heads % kv_heads:
            return f"head counts unknown or incompatible (H={num_heads}, Hkv={kv_heads})"
        scale = node.attributes.get_float("scale", 0.0)
        if not scale:
            if not head_dim:
                return "no scale attribute and head dim unknown"
            scale = 1.0 / math.sqrt(head_dim)
        return {
            "q": q,
            "k_concat": kparts,
            "v_concat": vparts,
            "num_heads": num_heads,
            "kv_heads": kv_heads,
            "scale": scale,
            "softcap": node.attributes.get_float("softcap", 0.0),
            "cropped": k_cropped,
        }

    def rewrite(self, model: ir.Model) -> tuple[bool, dict[str, Any]]:
        sdpa = fuse_sdpa(model)
        graph = model.graph
        mask = next((v for v in graph.inputs if v.name == MASK_INPUT), None)
        if mask is None:
            details = self._summary(model, sdpa, [], [], [])
            details["note"] = (
                f"graph has no '{MASK_INPUT}' input: attention stays Attention-23 "
                "(one node each), no KV-cache fusion"
            )
            return bool(sdpa["fused"]), details
        fused: list[dict[str, Any]] = []
        latent: list[dict[str, Any]] = []
        kept: list[dict[str, Any]] = []  # attention without a cache: Attention-23 is the fused op
        rejected: list[dict[str, str]] = []
        attn_nodes = [n for n in graph if n.op_type == "Attention" and n.domain == ""]
        for index, node in enumerate(attn_nodes):
            m = self._match(node)
            if m is LATENT:
                # MLA: the cache holds a latent; K/V are up-projected from all of it each step,
                # so attention needs no past inputs and the standard Attention-23 node already
                # is the fused kernel (one node, no Softmax). Record it as fused, as it is.
                latent.append(
                    {"node": node.name or "", "kind": "latent (MLA)", "op": "Attention-23"}
                )
                continue
            if m is NO_CACHE:
                kept.append({"node": node.name or "", "kind": "no KV cache", "op": "Attention-23"})
                continue
            if isinstance(m, str):
                rejected.append({"node": node.name or "", "reason": m})
                continue
            window, wsource = self._window(model, index, node)
            (ck, past_k, new_k), (cv, past_v, new_v) = m["k_concat"], m["v_concat"]
            attrs = {
                "scale": float(m["scale"]),
                "sliding_window": int(window),
                "num_heads": int(m["num_heads"]),
                "kv_num_heads": int(m["kv_heads"]),
            }
            if m["softcap"]:
                attrs["softcap"] = float(m["softcap"])
            layer_mask = mask
            if m["cropped"]:
                # HF's sliding-window cache layer crops the past before the Concat: attend over
                # the kept keys only, i.e. the last (P' + S) columns of the mask.
                layer_mask, crop_nodes = _crop_mask(mask, past_k, new_k)
                for n in crop_nodes:
                    graph.insert_before(node, n)
            gqa = ir.node(
                "GroupQueryAttention",
                [m["q"], new_k, new_v, past_k, past_v, layer_mask],
                attributes=attrs,
                domain=DOMAIN,
                num_outputs=3,
                name=f"{node.name or 'attention'}_gqa",
            )
            old = [node.outputs[0], ck.outputs[0], cv.outputs[0]]
            graph.insert_after(node, gqa)
            for o, new in zip(old, gqa.outputs):
                new.type, new.shape = o.type, o.shape
            ir.convenience.replace_all_uses_with(old, list(gqa.outputs), replace_graph_outputs=True)
            names = [o.name for o in old]
            graph.remove(node, safe=True)
            for o, name in zip(old, names):
                o.name = f"{name}__unfused"
            for new, name in zip(gqa.outputs, names):
                new.name = name
            fused.append(
                {"node": gqa.name, **attrs, "window_source": wsource, "cropped_past": m["cropped"]}
            )
        if fused:
            RemoveUnusedNodesPass()(model)
            TopologicalSortPass()(model)
            model.opset_imports[DOMAIN] = 1
        details = self._summary(model, sdpa, fused, latent, rejected, kept)
        return bool(fused or sdpa["fused"]), details

    def _summary(self, model, sdpa, fused, latent, rejected, kept=()) -> dict[str, Any]:
        """Report: GQA fusions, and per attention what it became or why it was left."""
        details: dict[str, Any] = {"matched": len(fused), "fused": fused}
        if sdpa["fused"] or sdpa["rejected"]:
            details["decomposed"] = {"matched": len(sdpa["fused"]), "fused": sdpa["fused"]}
        if latent:
            details["latent_attention"] = latent
        if kept:
            details["no_cache_attention"] = list(kept)  # one Attention-23 node each: fused
        if rejected or sdpa["rejected"]:
            details["rejected"] = [
                {**r, "stage": "Attention-23 over a KV cache -> GroupQueryAttention"}
                for r in rejected
            ] + [{**r, "stage": "decomposed attention -> Attention-23"} for r in sdpa["rejected"]]
        kinds = ("GroupQueryAttention", "Attention")
        details["attention_nodes"] = sum(
            1 for n in model.graph if n.op_type in kinds and n.domain in ("", DOMAIN)
        )
        details["softmax_left"] = sum(1 for n in model.graph if n.op_type == "Softmax")
        return details
