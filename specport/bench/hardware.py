"""How far decode is from the hardware: bytes a step reads, streaming bandwidth, memory.

Decode of a small LLM on CPU reads every weight once per step, so the honest yardstick is not a
peer but the memory system: `floor = bytes read per token / measured streaming bandwidth`. The
bandwidth is onnxruntime's own vector-by-matrix MatMul over a weight as large as the model's, on
the decode's thread count (so it reads from the same cache level the weights do, through the
same kernels); the report says when the weights fit in the last-level cache.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from specport.artifact import manifest as art
from specport.passes.mtp import BRANCH_OUTPUTS

if TYPE_CHECKING:
    from specport.bench.results import BenchConfig


def reset_peak_rss() -> None:
    """Linux: make VmHWM restart from the current RSS, so each engine's peak is its own."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def peak_rss_mb() -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    import resource

    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def measure_bandwidth(nbytes: int, repeats: int = 7, threads: int = 0) -> dict[str, Any]:
    """How fast onnxruntime streams `nbytes` of float32 weights on the decode's thread count.

    One MatMul [1, 512] x [512, N] over a weight as large as the model's is exactly the access
    pattern of a decode step (every weight byte read once, a vector in, a vector out) on the
    same kernels and threads; a single-threaded numpy copy would understate what the decode's
    threads get. GB/s as best and median of `repeats`."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    k = 512
    n = max(nbytes // 4 // k, 2048)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "stream",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k]),
            helper.make_tensor_value_info("w", TensorProto.FLOAT, [k, n]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    feeds = {
        "x": ort.OrtValue.ortvalue_from_numpy(np.ones((1, k), dtype=np.float32)),
        "w": ort.OrtValue.ortvalue_from_numpy(np.ones((k, n), dtype=np.float32)),
    }
    sess.run_with_ort_values(["y"], feeds)  # fault the pages in, warm the threads
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        sess.run_with_ort_values(["y"], feeds)
        rates.append(4 * k * n / (time.perf_counter() - t0) / 1e9)
    return {
        "buffer_mb": round(4 * k * n / 2**20, 1),
        "best_gb_s": round(max(rates), 2),
        "median_gb_s": round(statistics.median(rates), 2),
        "method": f"onnxruntime MatMul 1x{k} by {k}x{n}, {threads or 'default'} threads",
    }


def last_level_cache_bytes() -> int | None:
    """Size of the CPU's last-level cache (Linux sysfs), or None where it cannot be read."""
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    best = None
    for idx in sorted(base.glob("index*")):
        try:
            text = (idx / "size").read_text().strip().upper()
            mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            size = int(text.rstrip("KMG")) * mult
        except (OSError, ValueError):
            continue
        best = size if best is None else max(best, size)
    return best


# (op, input index) of tables a step reads one row of per token: a float embedding, and a
# quantized one's codes, scales and zero points
GATHERED = {("Gather", 0), ("GatherBlockQuantized", 0), ("GatherBlockQuantized", 2)}
GATHERED |= {("GatherBlockQuantized", 3)}


def plain_decode_nodes(proto: Any) -> list[Any]:
    """The nodes a plain decode step runs: those the graph's outputs need, less an MTP artifact's
    branch (the runtime strips it at load unless decoding with `--speculative mtp`, see
    ``runtime.session.artifact_graph``), so its heads' weights are not counted as read."""

    producer = {out: node for node in proto.graph.node for out in node.output if out}
    wanted = [o.name for o in proto.graph.output if o.name not in BRANCH_OUTPUTS]
    needed: set[int] = set()
    while wanted:
        node = producer.get(wanted.pop())
        if node is None or id(node) in needed:
            continue
        needed.add(id(node))
        wanted.extend(_node_inputs(node))
    return [node for node in proto.graph.node if id(node) in needed]


def _node_inputs(node: Any) -> list[str]:
    """A node's inputs, with the outer names its subgraphs (If/Loop bodies) read."""
    return [name for name in node.input if name] + _subgraph_inputs(node)


def _subgraph_inputs(node: Any) -> list[str]:
    names: list[str] = []
    for attr in node.attribute:
        for graph in [attr.g] if attr.HasField("g") else list(attr.graphs):
            for inner in graph.node:
                names.extend(_node_inputs(inner))
    return names


def bytes_per_token(model_path: Path) -> dict[str, int]:
    """Weight bytes one plain decode step reads: every initializer its nodes use, except tables
    only gathered from (embedding: one row per token). Read from the graph, not the config, so
    fusions and quantized layouts are counted as they ship; an MTP artifact's heads are counted
    apart (`not_in_plain_decode`), since plain decoding runs without them."""
    import onnx

    proto = onnx.load(str(model_path), load_external_data=False)
    sizes: dict[str, int] = {}
    rows: dict[str, int] = {}
    for t in proto.graph.initializer:
        itemsize = onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
        count = int(np.prod(t.dims)) if len(t.dims) else 1
        sizes[t.name] = count * itemsize
        rows[t.name] = sizes[t.name] // max(int(t.dims[0]), 1) if len(t.dims) else sizes[t.name]
    uses: dict[str, list[tuple[str, int]]] = {}
    for node in plain_decode_nodes(proto):
        for idx, name in enumerate(node.input):
            if name in sizes:
                uses.setdefault(name, []).append((node.op_type, idx))
        for name in _subgraph_inputs(node):
            if name in sizes:
                uses.setdefault(name, []).append((node.op_type, -1))
    total = gathered = 0
    for name in uses:
        if all((op, i) in GATHERED for op, i in uses[name]):
            gathered += sizes[name]
            total += rows[name]
        else:
            total += sizes[name]
    read = sum(sizes[name] for name in uses)
    return {
        "weights": total,
        "gather_tables": gathered,
        "all_initializers": read,  # what a plain decode session holds
        "not_in_plain_decode": sum(sizes.values()) - read,  # an MTP artifact's heads
    }


def kv_bytes_per_token(manifest: art.Manifest, avg_length: float, batch: int) -> int:
    """KV bytes one decode step reads for `batch` rows at average cache length `avg_length`."""
    kv = manifest.kv
    per_pos = sum(
        h * (k + v) * np.dtype(dt).itemsize
        for h, k, v, dt in zip(kv.num_heads, kv.key_dim, kv.value_dim, kv.dtypes())
    )
    return int(per_pos * avg_length * batch)


def hardware_floor(
    manifest: art.Manifest,
    config: BenchConfig,
    weights: dict[str, int],
    samples: list[dict[str, float]],
) -> dict[str, Any]:
    """Bytes per decode step and the TPOT the measured bandwidth allows at best (per round too)."""
    avg_len = config.prompt_len + config.new_tokens / 2
    kv = kv_bytes_per_token(manifest, avg_len, config.batch)
    step_bytes = weights["weights"] + kv
    per_run = [
        {
            "median_gb_s": s["median_gb_s"],
            "floor_tpot_ms": round(step_bytes / (s["median_gb_s"] * 1e9) * 1e3, 3),
        }
        for s in samples
    ]
    bw = statistics.median(s["median_gb_s"] for s in samples)
    floor_s = step_bytes / (bw * 1e9)
    llc = last_level_cache_bytes()
    return {
        "last_level_cache_bytes": llc,
        "weights_fit_in_cache": bool(llc and step_bytes <= llc),
        "weight_bytes_per_step": weights["weights"],
        "kv_bytes_per_step": kv,
        "bandwidth": {
            "buffer_mb": samples[0]["buffer_mb"],
            "median_gb_s": round(bw, 2),
            "best_gb_s": max(s["best_gb_s"] for s in samples),
            "method": samples[0].get("method"),
        },
        "floor_tpot_ms": round(floor_s * 1e3, 3),
        "floor_decode_tok_per_s": round(config.batch / floor_s, 2),
        "per_run": per_run,
        "cpu_count": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()]
        if hasattr(os, "getloadavg")
        else None,
    }
