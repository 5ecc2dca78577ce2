"""One decode step's attention in three layouts of onnxruntime's CPU GroupQueryAttention.

- exported: one query row per token, every query head its own (row, head) task;
- padded: the token's row plus a zero dummy row made valid by ``query_seqlens`` (the layout
  ``passes/pad_attention_rows.py`` gives ``--exact-speculation`` graphs: runs of two or more
  rows compute every row the same way);
- grouped: the query heads that share a KV head given as that many rows of one head, an
  attention bias hiding from each row the positions it may not see, so that each KV head is
  read and packed once per step instead of once per query head. Its rows are never a single
  row, so it is row-invariant as the padded layout is.

Each timed run first reads ``--evict-mib`` MiB (default twice a 32 MiB L3), so the layer reads
its cache from memory as in a whole step, where every layer's weights pass through the caches
between two attention nodes; cache-warm, the grouped layout looks 1.7-1.9x faster than the
exported one, from memory it is not (docs/benchmarks/2026-12-06-grouped-rows.md, which also
builds it into a whole graph with ``benchmarks/grouped_rows_graph.py``).

Each layout runs on the same random queries, keys and cache (KV bound in place), the
per-layer time is the median of ``--runs`` runs, and the output is compared with the exported
layout's. Usage:

    python -m benchmarks.attention_layouts [--shapes 1x128,1x512,1x2048,8x200,64x700]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from benchmarks.decode_step_ops import parse_shapes

LENGTH = 4096  # positions per row in the bound cache buffer


def _session(heads: int, kv_heads: int, dim: int, rows: int, extra: set[str], threads: int) -> Any:
    """A single GroupQueryAttention node, with the optional inputs named in `extra`."""
    names = ["q", "k", "v", "pk", "pv", "sk", "tl"]
    inputs = [
        helper.make_tensor_value_info("q", TensorProto.FLOAT, ["b", rows, heads * dim]),
        helper.make_tensor_value_info("k", TensorProto.FLOAT, ["b", rows, kv_heads * dim]),
        helper.make_tensor_value_info("v", TensorProto.FLOAT, ["b", rows, kv_heads * dim]),
        helper.make_tensor_value_info("pk", TensorProto.FLOAT, ["b", kv_heads, LENGTH, dim]),
        helper.make_tensor_value_info("pv", TensorProto.FLOAT, ["b", kv_heads, LENGTH, dim]),
        helper.make_tensor_value_info("sk", TensorProto.INT32, ["b"]),
        helper.make_tensor_value_info("tl", TensorProto.INT32, []),
    ]
    if extra:  # inputs 10 (attention_bias) and 16 (query_seqlens)
        bias = "bias" if "bias" in extra else ""
        names += ["", "", "", bias, "", "", "", "", "", "qs"]
        inputs.append(helper.make_tensor_value_info("qs", TensorProto.INT32, ["b"]))
        if bias:
            inputs.append(
                helper.make_tensor_value_info("bias", TensorProto.FLOAT, ["b", 1, rows, "t"])
            )
    node = helper.make_node(
        "GroupQueryAttention",
        names,
        ["o", "prk", "prv"],
        domain="com.microsoft",
        num_heads=heads,
        kv_num_heads=kv_heads,
    )
    outputs = [
        helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("o", "prk", "prv")
    ]
    graph = helper.make_graph([node], "attention", inputs, outputs)
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    )
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    options.log_severity_level = 3
    options.add_session_config_entry("session.intra_op.allow_spinning", "1")
    return ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )


def _time(run: Callable[[], None], runs: int, evict: np.ndarray | None) -> float:
    """Median seconds of `run`; with `evict`, every timed run starts after reading that array
    (twice the last-level cache), so the cache is read from memory as in a whole decode step,
    where every layer's weights pass through the caches between two attention nodes."""
    for _ in range(3):
        run()
    times = []
    for _ in range(runs):
        if evict is not None:
            evict.sum()
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(
    rows: int,
    context: int,
    heads: int,
    kv_heads: int,
    dim: int,
    threads: int,
    runs: int,
    evict_mib: int = 0,
) -> dict[str, Any]:
    """Time one attention layer in each layout; `evict_mib` > 0 reads that many MiB before
    every timed run (cache-cold, as in a whole step), 0 times it cache-warm."""
    group = heads // kv_heads
    evict = np.ones(evict_mib << 18, np.float32) if evict_mib > 0 else None
    rng = np.random.default_rng(0)
    cache_k = rng.standard_normal((rows, kv_heads, LENGTH, dim)).astype(np.float32)
    cache_v = rng.standard_normal((rows, kv_heads, LENGTH, dim)).astype(np.float32)
    query = rng.standard_normal((rows, heads, dim)).astype(np.float32)
    key = rng.standard_normal((rows, kv_heads * dim)).astype(np.float32)
    value = rng.standard_normal((rows, kv_heads * dim)).astype(np.float32)
    past = context - 1  # cached positions before the new token

    def layout(
        q: np.ndarray, k: np.ndarray, v: np.ndarray, n_heads: int, extra: dict | None
    ) -> tuple[float, np.ndarray]:
        session = _session(n_heads, kv_heads, dim, q.shape[1], set(extra or {}), threads)
        binding = session.io_binding()
        kept = [ort.OrtValue.ortvalue_from_numpy(c.copy()) for c in (cache_k, cache_v)]
        for name, array in (("q", q), ("k", k), ("v", v)):
            binding.bind_cpu_input(name, np.ascontiguousarray(array))
        binding.bind_ortvalue_input("pk", kept[0])
        binding.bind_ortvalue_input("pv", kept[1])
        binding.bind_ortvalue_output("prk", kept[0])
        binding.bind_ortvalue_output("prv", kept[1])
        new = q.shape[1]
        binding.bind_cpu_input("sk", np.full(rows, past + new - 1, np.int32))
        binding.bind_cpu_input("tl", np.array(past + new, np.int32))
        for name, array in (extra or {}).items():
            binding.bind_cpu_input(name, array)
        binding.bind_output("o")
        seconds = _time(lambda: session.run_with_iobinding(binding), runs, evict)
        return seconds, binding.get_outputs()[2].numpy()

    exported_s, reference = layout(
        query.reshape(rows, 1, heads * dim), key[:, None], value[:, None], heads, None
    )
    reference = reference.reshape(rows, heads, dim)

    def two_rows(real: np.ndarray) -> np.ndarray:
        padded = np.zeros((rows, 2, real.shape[-1]), np.float32)
        padded[:, 0] = real
        return padded

    padded_s, out = layout(
        two_rows(query.reshape(rows, heads * dim)),
        two_rows(key),
        two_rows(value),
        heads,
        {"qs": np.full(rows, 2, np.int32)},
    )
    padded_diff = float(np.abs(out[:, 0].reshape(rows, heads, dim) - reference).max())

    # row g of KV head h is query head h * group + g; the token's key and value are row 0, the
    # other rows' slots (past the valid length, overwritten later) take copies
    grouped_q = query.reshape(rows, kv_heads, group, dim).transpose(0, 2, 1, 3)
    bias = np.zeros((rows, 1, group, past + group), np.float32)
    bias[..., past + 1 :] = -np.inf
    grouped_s, out = layout(
        grouped_q.reshape(rows, group, kv_heads * dim),
        np.repeat(key[:, None], group, axis=1),
        np.repeat(value[:, None], group, axis=1),
        kv_heads,
        {"bias": bias, "qs": np.full(rows, group, np.int32)},
    )
    out = out.reshape(rows, group, kv_heads, dim).transpose(0, 2, 1, 3).reshape(rows, heads, dim)
    return {
        "rows": rows,
        "context": context,
        "exported_ms": exported_s * 1e3,
        "padded_ms": padded_s * 1e3,
        "grouped_ms": grouped_s * 1e3,
        "padded_diff": padded_diff,
        "grouped_diff": float(np.abs(out - reference).max()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shapes",
        type=parse_shapes,
        default="1x128,1x512,1x2048,8x200,64x700",
        help="ROWSxCONTEXT,...",
    )
    parser.add_argument("--heads", type=int, default=9, help="query heads (SmolLM2-135M: 9)")
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument(
        "--evict-mib",
        type=int,
        default=64,
        help="MiB read before every timed run, so the cache comes from memory as in a whole "
        "step (default 64: twice a 32 MiB L3); 0 = cache-warm, the layer rerun on hot data",
    )
    args = parser.parse_args()
    if min(args.heads, args.kv_heads, args.head_size) < 1 or args.heads % args.kv_heads:
        parser.error("--heads must be a positive multiple of --kv-heads, --head-size positive")
    print(
        f"{args.heads} query heads, {args.kv_heads} KV heads of {args.head_size}, "
        f"{args.threads} threads; ms per layer (median of {args.runs}; "
        + (f"{args.evict_mib} MiB read before each run)" if args.evict_mib else "cache-warm)")
    )
    print(
        "| rows x context | exported | padded to 2 rows | grouped | grouped vs padded | max diff |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for rows, context in args.shapes:
        r = measure(
            rows,
            context,
            args.heads,
            args.kv_heads,
            args.head_size,
            args.threads,
            args.runs,
            args.evict_mib,
        )
        print(
            f"| {rows} x {context} | {r['exported_ms']:.3f} | {r['padded_ms']:.3f} | "
            f"{r['grouped_ms']:.3f} | {r['padded_ms'] / r['grouped_ms']:.2f}x | "
            f"{max(r['padded_diff'], r['grouped_diff']):.1e} |"
        )


if __name__ == "__main__":
    main()
