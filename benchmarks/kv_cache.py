"""Kernel-level cost of the shared layout's KV cache dtype: GroupQueryAttention alone, fp32 vs int8.

A model's decode step mixes weight reads (fixed) with attention over the cache (growing with the
context), so on a loaded machine the attention share is hard to see in `specport bench`. This
measures only the attention: `layers` com.microsoft.GroupQueryAttention nodes chained as in a
model (each layer's output is the next one's query), every layer over its own in-place buffer
bound as past and present, exactly as the runtime binds them. Caches: fp32, and int8 with a
per-tensor or per-channel scale (`quantize --kv-cache int8`). Variants alternate within every
round; figures are medians, speedups medians of per-round ratios (a loaded machine moves all
variants of a round alike).

    python -m benchmarks.kv_cache --heads 9 --kv-heads 3 --head-dim 64 \
        --layers 30 --contexts 512 2048 4096 --prefill 1024 --threads 2
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

VARIANTS = ("fp32", "int8 per_tensor", "int8 per_channel")


@dataclass
class Shapes:
    heads: int = 9
    kv_heads: int = 3
    head_dim: int = 64
    layers: int = 30


def _graph(shapes: Shapes, variant: str, length: int) -> bytes:
    from onnx import TensorProto, helper

    h, kvh, d = shapes.heads, shapes.kv_heads, shapes.head_dim
    cache = TensorProto.FLOAT if variant == "fp32" else TensorProto.INT8
    f = TensorProto.FLOAT
    inputs = [
        helper.make_tensor_value_info("q", f, ["B", "S", h * d]),
        helper.make_tensor_value_info("k", f, ["B", "S", kvh * d]),
        helper.make_tensor_value_info("v", f, ["B", "S", kvh * d]),
        helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["B"]),
        helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, []),
    ]
    outputs, nodes, inits = [], [], []
    query = "q"
    for i in range(shapes.layers):
        for kind in ("key", "value"):
            inputs.append(
                helper.make_tensor_value_info(f"past.{i}.{kind}", cache, ["B", kvh, length, d])
            )
            outputs.append(helper.make_tensor_value_info(f"present.{i}.{kind}", cache, None))
        names = [
            query,
            "k",
            "v",
            f"past.{i}.key",
            f"past.{i}.value",
            "seqlens_k",
            "total_sequence_length",
        ]
        attrs: dict[str, Any] = {"num_heads": h, "kv_num_heads": kvh}
        if variant != "fp32":
            per_channel = variant.endswith("per_channel")
            shape = [1, kvh, 1, d] if per_channel else [1]
            for kind in ("k", "v"):
                value = np.full(int(np.prod(shape)), 0.05, np.float32)
                inits.append(helper.make_tensor(f"{kind}_scale.{i}", f, shape, value))
            names += ["", "", "", "", "", f"k_scale.{i}", f"v_scale.{i}"]
            quant = "PER_CHANNEL" if per_channel else "PER_TENSOR"
            attrs.update(kv_cache_bit_width=8, k_quant_type=quant, v_quant_type=quant)
        out = f"out.{i}"
        nodes.append(
            helper.make_node(
                "GroupQueryAttention",
                names,
                [out, f"present.{i}.key", f"present.{i}.value"],
                domain="com.microsoft",
                **attrs,
            )
        )
        query = out
    outputs.insert(0, helper.make_tensor_value_info(query, f, None))
    graph = helper.make_graph(nodes, "gqa_cache", inputs, outputs, initializer=inits)
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets).SerializeToString()


class _Variant:
    """One session and its bound buffers; `step(S, P)` appends S positions after P."""

    def __init__(self, shapes: Shapes, variant: str, length: int, threads: int) -> None:
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.shapes = shapes
        self.sess = ort.InferenceSession(
            _graph(shapes, variant, length), so, ["CPUExecutionProvider"]
        )
        rng = np.random.default_rng(0)
        shape = (1, shapes.kv_heads, length, shapes.head_dim)
        self.buffers = [
            rng.standard_normal(shape).astype(np.float32)
            if variant == "fp32"
            else rng.integers(-100, 100, shape).astype(np.int8)
            for _ in range(2 * shapes.layers)
        ]
        self.values = [ort.OrtValue.ortvalue_from_numpy(b) for b in self.buffers]
        self.rng = rng

    def step(self, s: int, past: int) -> float:
        sh = self.shapes
        b = self.sess.io_binding()
        q = (self.rng.standard_normal((1, s, sh.heads * sh.head_dim)) * 0.3).astype(np.float32)
        kv = np.ascontiguousarray(q[:, :, : sh.kv_heads * sh.head_dim])
        for name, arr in (("q", q), ("k", kv), ("v", kv)):
            b.bind_cpu_input(name, arr)
        b.bind_cpu_input("seqlens_k", np.array([past + s - 1], np.int32))
        b.bind_cpu_input("total_sequence_length", np.array(past + s, np.int32))
        for i in range(sh.layers):
            for j, kind in enumerate(("key", "value")):
                b.bind_ortvalue_input(f"past.{i}.{kind}", self.values[2 * i + j])
                b.bind_ortvalue_output(f"present.{i}.{kind}", self.values[2 * i + j])
        b.bind_output(f"out.{sh.layers - 1}")
        t0 = time.perf_counter()
        self.sess.run_with_iobinding(b)
        return time.perf_counter() - t0


def measure(
    shapes: Shapes,
    contexts: Sequence[int],
    prefill: int | None = None,
    rounds: int = 20,
    threads: int = 2,
) -> dict[str, Any]:
    """{variant: {"decode_ms": {context: median ms}, "speedup_vs_fp32": {context: median of
    per-round fp32/variant time ratios}, "prefill_ms": median ms}} plus the setup."""
    length = max([*contexts, prefill or 0]) + 1
    variants = {v: _Variant(shapes, v, length, threads) for v in VARIANTS}
    report: dict[str, Any] = {v: {"decode_ms": {}} for v in VARIANTS}
    for ctx in contexts:
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for r in range(rounds + 2):  # two warm-up rounds
            for v, runner in variants.items():
                t = runner.step(1, ctx)
                if r >= 2:
                    times[v].append(t)
        for v in VARIANTS:
            report[v]["decode_ms"][ctx] = round(statistics.median(times[v]) * 1e3, 3)
            ratios = [f / t for f, t in zip(times["fp32"], times[v])]
            report[v].setdefault("speedup_vs_fp32", {})[ctx] = round(statistics.median(ratios), 3)
        logger.info("context %d: %s", ctx, {v: report[v]["decode_ms"][ctx] for v in VARIANTS})
    if prefill:
        times = {v: [] for v in VARIANTS}
        for _ in range(max(1, rounds // 10)):
            for v, runner in variants.items():
                times[v].append(runner.step(prefill, 0))
        for v in VARIANTS:
            report[v]["prefill_ms"] = round(statistics.median(times[v]) * 1e3, 3)
    report["setup"] = {**vars(shapes), "threads": threads, "rounds": rounds, "prefill": prefill}
    return report


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 4096])
    p.add_argument("--prefill", type=int, default=None, help="also time one prefill this long")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    shapes = Shapes(args.heads, args.kv_heads, args.head_dim, args.layers)
    report = measure(shapes, args.contexts, args.prefill, args.rounds, args.threads)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
