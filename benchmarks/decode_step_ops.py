"""Where a decode step's time goes at a given batch and context, KV bound as specport binds it.

A server's throughput at many streams is the time of one step over all its rows. This runs
one-token steps of an artifact's graph for ``--rows`` rows that each hold ``--context`` cached
positions, with every layer's past and present bound to one buffer (as ``runtime/kv``
binds them), and prints the step's wall time, the time per op type (onnxruntime's profiler)
and, for GroupQueryAttention, the cached keys and values it reads per step against the
machine's streaming read bandwidth (a ReduceSum over 1 GiB, same threads). Usage:

    python -m benchmarks.decode_step_ops ARTIFACT [--shapes 1x512,8x200,64x700] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from specport.artifact.manifest import read_manifest

READ_BYTES = 1 << 30


def _options(threads: int, profile_prefix: str | None = None) -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    options.log_severity_level = 3
    options.add_session_config_entry("session.intra_op.allow_spinning", "1")
    if profile_prefix:
        options.enable_profiling, options.profile_file_prefix = True, profile_prefix
    return options


def read_bandwidth(threads: int, runs: int = 5) -> float:
    """Bytes per second a ReduceSum streams from memory on `threads` threads."""
    n = READ_BYTES // 4
    graph = helper.make_graph(
        [helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=0)],
        "read",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, n // 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [helper.make_tensor("axes", TensorProto.INT64, [1], [1])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    session = ort.InferenceSession(
        model.SerializeToString(), _options(threads), providers=["CPUExecutionProvider"]
    )
    x = np.ones((64, n // 64), np.float32)
    session.run(None, {"x": x})
    start = time.perf_counter()
    for _ in range(runs):
        session.run(None, {"x": x})
    return x.nbytes * runs / (time.perf_counter() - start)


def _int_type(session: ort.InferenceSession, name: str) -> type:
    types = {i.name: i.type for i in session.get_inputs()}
    return np.int64 if "int64" in types[name] else np.int32


def _bind(session: ort.InferenceSession, rows: int, context: int, length: int) -> tuple[Any, list]:
    """An IO binding for one-token steps of `rows` rows with `context` cached positions."""
    binding, kept = session.io_binding(), []
    rng = np.random.default_rng(0)
    for i in session.get_inputs():
        if not i.name.startswith("past_key_values"):
            continue
        dtype = np.int8 if "int8" in i.type else np.float32
        shape = (rows, i.shape[1], length, i.shape[3])
        value = ort.OrtValue.ortvalue_from_numpy((rng.standard_normal(shape) * 0.1).astype(dtype))
        kept.append(value)
        binding.bind_ortvalue_input(i.name, value)
        binding.bind_ortvalue_output(i.name.replace("past_key_values", "present"), value)
    names = {i.name for i in session.get_inputs()}
    binding.bind_cpu_input("input_ids", np.ones((rows, 1), np.int64))  # any id in the vocabulary
    binding.bind_cpu_input("seqlens_k", np.full((rows,), context, _int_type(session, "seqlens_k")))
    binding.bind_cpu_input(
        "total_sequence_length",
        np.array(context + 1, _int_type(session, "total_sequence_length")),
    )
    if "logits_index" in names:
        binding.bind_cpu_input(
            "logits_index", np.zeros((rows, 1), _int_type(session, "logits_index"))
        )
    binding.bind_output("logits")
    return binding, kept


def kv_bytes_read(session: ort.InferenceSession, rows: int, context: int) -> int:
    """Bytes of cached keys and values one step's attention reads (each position once)."""
    total = 0
    for i in session.get_inputs():
        if i.name.startswith("past_key_values"):
            itemsize = 1 if "int8" in i.type else 4
            total += rows * i.shape[1] * (context + 1) * i.shape[3] * itemsize
    return total


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """`ROWSxCONTEXT,...` as (rows, context) pairs (an argparse type: a clear usage error)."""
    try:
        shapes = [(int(r), int(c)) for r, c in (s.split("x") for s in text.split(","))]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: want ROWSxCONTEXT,... e.g. 1x512,64x700"
        ) from None
    if any(r < 1 or c < 1 for r, c in shapes):
        raise argparse.ArgumentTypeError(f"{text!r}: rows and context are at least 1")
    return shapes


def measure(
    artifact: Path, rows: int, context: int, threads: int, steps: int, tmp: str
) -> dict[str, Any]:
    length = max(4096, context + 2)
    model = str(artifact / "model.onnx")
    # the step's wall time unprofiled (the profiler's events cost time per node), then a
    # profiled session for the split by op type
    session = ort.InferenceSession(model, _options(threads), providers=["CPUExecutionProvider"])
    if "seqlens_k" not in {i.name for i in session.get_inputs()}:
        raise SystemExit(f"{artifact}: not a shared-KV-layout graph (no seqlens_k input)")
    binding, _kept = _bind(session, rows, context, length)
    for _ in range(3):
        session.run_with_iobinding(binding)
    start = time.perf_counter()
    for _ in range(steps):
        session.run_with_iobinding(binding)
    step = (time.perf_counter() - start) / steps
    kv_bytes = kv_bytes_read(session, rows, context)
    del session, binding, _kept
    session = ort.InferenceSession(
        model, _options(threads, f"{tmp}/{rows}x{context}"), providers=["CPUExecutionProvider"]
    )
    binding, _kept = _bind(session, rows, context, length)
    for _ in range(3 + steps):
        session.run_with_iobinding(binding)
    events = json.loads(Path(session.end_profiling()).read_text())
    per_op: Counter[str] = Counter()
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("kernel_time"):
            per_op[e["args"]["op_name"]] += e["dur"]
    runs = steps + 3
    return {
        "rows": rows,
        "context": context,
        "step_ms": step * 1e3,
        "ops_ms": {op: us / runs / 1e3 for op, us in per_op.most_common()},
        "kv_bytes": kv_bytes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument(
        "--shapes", type=parse_shapes, default="1x512,8x200,64x700", help="ROWSxCONTEXT,..."
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--top", type=int, default=4, help="op types shown per shape")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    read_manifest(args.artifact, check_hashes=False)  # a clear error for a non-artifact
    print("measuring the streaming read bandwidth", file=sys.stderr)
    bandwidth = read_bandwidth(args.threads)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for rows, context in args.shapes:
            print(f"measuring {rows} rows x {context} positions", file=sys.stderr)
            results.append(measure(args.artifact, rows, context, args.threads, args.steps, tmp))
    if args.json:
        print(json.dumps({"read_bandwidth": bandwidth, "results": results}))
        return
    print(
        f"{args.artifact.name}, {args.threads} threads; streaming read {bandwidth / 1e9:.1f} GB/s"
    )
    print(
        "| rows x context | step ms | tok/s | attention ms (KV read GB/s) | "
        f"top {args.top} op types, ms per profiled step |"
    )
    print("|---|---:|---:|---:|---|")
    for r in results:
        attn = r["ops_ms"].get("GroupQueryAttention", 0.0)
        rate = r["kv_bytes"] / (attn / 1e3) / 1e9 if attn else 0.0
        top = ", ".join(f"{op} {ms:.2f}" for op, ms in list(r["ops_ms"].items())[: args.top])
        print(
            f"| {r['rows']} x {r['context']} | {r['step_ms']:.2f} | "
            f"{r['rows'] / r['step_ms'] * 1e3:.0f} | {attn:.2f} ({rate:.1f}) | {top} |"
        )


if __name__ == "__main__":
    main()
