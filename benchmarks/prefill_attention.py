"""Where one prompt's prefill goes, with the KV bound as specport binds it or fed as arrays.

A profile of a prefill taken through a plain ``InferenceSession.run`` feeds every layer's past
as a fresh array: GroupQueryAttention then copies each layer's whole past buffer into a new
present buffer, and the copy is charged to the attention node. specport's runtime binds past
and present to one buffer per layer (IO binding), so no copy happens. This runs one prompt of
``--tokens`` real tokens through an artifact's graph both ways, at KV buffer lengths of
``--lengths`` positions, in alternating rounds, and prints the run time, GroupQueryAttention's
median time per call and MatMul's share (onnxruntime's profiler). Usage:

    python -m benchmarks.prefill_attention ARTIFACT [--tokens 869] [--lengths 2048,8192]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from tokenizers import Tokenizer

from specport.artifact.manifest import read_manifest
from specport.core.settings import shared_dir

TEXT = shared_dir() / "text" / "tinystories_valid_dev.txt"


def _prompt(artifact: Path, tokens: int, text_file: Path) -> np.ndarray:
    if not text_file.is_file():
        raise SystemExit(
            f"no text at {text_file}: pass --text FILE, or set SPECPORT_SHARED to the shared folder"
        )
    tok = Tokenizer.from_file(str(artifact / "tokenizer.json"))
    ids = tok.encode(text_file.read_text()[: tokens * 20]).ids[:tokens]
    if len(ids) < tokens:
        raise SystemExit(f"{text_file} holds fewer than {tokens} tokens")
    return np.array([ids], dtype=np.int64)


def _feeds(session: ort.InferenceSession, ids: np.ndarray) -> dict[str, np.ndarray]:
    """The graph's non-KV inputs for one prompt on an empty past, in the graph's own types."""
    t = ids.shape[1]
    types = {i.name: i.type for i in session.get_inputs()}
    feeds: dict[str, np.ndarray] = {"input_ids": ids}
    for name, value in (("seqlens_k", [t - 1]), ("total_sequence_length", t)):
        feeds[name] = np.array(value, np.int64 if "int64" in types[name] else np.int32)
    if "logits_index" in types:
        feeds["logits_index"] = np.array(
            [[t - 1]], np.int64 if "int64" in types["logits_index"] else np.int32
        )
    return feeds


def _profiled(artifact: Path, threads: int, prefix: str) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    options.enable_profiling, options.profile_file_prefix = True, prefix
    return ort.InferenceSession(
        str(artifact / "model.onnx"), options, providers=["CPUExecutionProvider"]
    )


def _kv_shape(session: ort.InferenceSession, length: int) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for i in session.get_inputs():
        if i.name.startswith("past_key_values"):
            shapes[i.name] = (1, i.shape[1], length, i.shape[3])
    return shapes


def _run_arrays(
    session: ort.InferenceSession, feeds: dict, length: int, runs: int, every_output: bool
) -> list[float]:
    kv = {n: np.zeros(s, np.float32) for n, s in _kv_shape(session, length).items()}
    fetched = None if every_output else ["logits"]
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        session.run(fetched, {**feeds, **kv})
        times.append(time.perf_counter() - start)
    return times


def _run_bound(session: ort.InferenceSession, feeds: dict, length: int, runs: int) -> list[float]:
    binding = session.io_binding()
    for name, value in feeds.items():
        binding.bind_cpu_input(name, value)
    kept: list[Any] = []
    for name, shape in _kv_shape(session, length).items():
        value = ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, np.float32))
        kept.append(value)
        binding.bind_ortvalue_input(name, value)
        binding.bind_ortvalue_output(name.replace("past_key_values", "present"), value)
    binding.bind_output("logits")
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        session.run_with_iobinding(binding)
        times.append(time.perf_counter() - start)
    return times


RUNNERS: dict[str, Callable[[ort.InferenceSession, dict, int, int], list[float]]] = {
    "arrays, every output fetched": partial(_run_arrays, every_output=True),
    "arrays, logits fetched": partial(_run_arrays, every_output=False),
    "bound (specport)": _run_bound,
}


def _node_ms(profile: str, op: str) -> list[float]:
    events = json.loads(Path(profile).read_text())
    return [
        e["dur"] / 1e3
        for e in events
        if e.get("cat") == "Node"
        and e["args"].get("op_name") == op
        and e["name"].endswith("kernel_time")
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--tokens", type=int, default=869)
    parser.add_argument("--lengths", default="2048,8192", help="KV buffer lengths (positions)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3, help="timed runs per round, after one")
    parser.add_argument("--text", type=Path, default=TEXT)
    args = parser.parse_args()
    read_manifest(
        args.artifact, check_hashes=False
    )  # a clear error for a directory that is not an artifact
    ids = _prompt(args.artifact, args.tokens, args.text)
    lengths = [int(x) for x in args.lengths.split(",")]
    rows: dict[tuple[str, int], dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for length in lengths:
                for how, runner in RUNNERS.items():
                    session = _profiled(args.artifact, args.threads, f"{tmp}/{len(rows)}")
                    feeds = _feeds(session, ids)
                    runner(session, feeds, length, 1)  # warm-up, profiled too: dropped below
                    times = runner(session, feeds, length, args.runs)
                    profile = session.end_profiling()
                    calls = len(_node_ms(profile, "GroupQueryAttention")) // (args.runs + 1)
                    attn = _node_ms(profile, "GroupQueryAttention")[calls:]
                    matmul = _node_ms(profile, "MatMul") + _node_ms(profile, "MatMulNBits")
                    row = rows.setdefault((how, length), {"run": [], "attn": [], "mm": []})
                    row["run"] += times
                    row["attn"] += attn
                    row["mm"].append(sum(matmul) / (args.runs + 1))
    print(f"{args.tokens}-token prompt, {args.threads} threads, {args.rounds} rounds")
    print(
        "| KV fed as | buffer length | run ms (median) | attention ms per call | MatMul ms per run |"
    )
    print("|---|---:|---:|---:|---:|")
    for (how, length), row in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        print(
            f"| {how} | {length} | {statistics.median(row['run']) * 1e3:.0f} "
            f"| {statistics.median(row['attn']):.2f} | {statistics.median(row['mm']):.0f} |"
        )


if __name__ == "__main__":
    main()
