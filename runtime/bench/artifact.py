"""Benchmark an artifact: latency/throughput, overhead, memory, and how far it is from the hardware.

Decode of a small LLM on CPU reads every weight once per step, so the honest yardstick is not a
peer but the memory system: `floor = bytes read per token / measured streaming bandwidth`. The
bandwidth is onnxruntime's own vector-by-matrix MatMul over a weight as large as the model's, on
the decode's thread count (so it reads from the same cache level the weights do, through the
same kernels); the report says when the weights fit in the last-level cache. Peers (onnxruntime-genai, transformers) run in this process, on the same
prompts, with the same thread count, after ours; every engine gets a warm-up run first.
"""

from __future__ import annotations

import contextlib
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from specport import artifact as art

logger = logging.getLogger(__name__)

# lower is better; cpu_ms_per_token = process CPU time (all threads) per generated token, which
# a shared machine's load disturbs far less than wall time
TIME_KEYS = ("ttft_ms", "tpot_ms", "cpu_ms_per_token")
RATE_KEYS = ("decode_tok_per_s", "prefill_tok_per_s")  # higher is better


@dataclass
class BenchConfig:
    prompt_len: int = 32
    new_tokens: int = 128
    batch: int = 1
    runs: int = 5
    threads: int = 0
    allow_spinning: bool | None = None
    provider: str = "cpu"
    prompt_ids: list[int] | None = None
    seed: int = 0
    peer_gguf: str | None = None  # the GGUF llama.cpp runs when the artifact's source is not one


@dataclass
class EngineResult:
    name: str
    runs: list[dict[str, Any]] = field(default_factory=list)
    peak_rss_mb: float | None = None
    info: dict[str, Any] = field(default_factory=dict)

    def median(self, key: str) -> float | None:
        vals = [r[key] for r in self.runs if r.get(key) is not None]
        return round(statistics.median(vals), 3) if vals else None

    def best(self, key: str) -> float | None:
        vals = [r[key] for r in self.runs if r.get(key) is not None]
        if not vals:
            return None
        return round(min(vals) if key in TIME_KEYS else max(vals), 3)

    def summary(self) -> dict[str, Any]:
        keys = (*TIME_KEYS, *RATE_KEYS, "framework_overhead_pct")
        out: dict[str, Any] = {k: self.median(k) for k in keys}
        out["best"] = {k: self.best(k) for k in (*TIME_KEYS, *RATE_KEYS)}
        out["spread_pct"] = _spread(self.runs, "decode_tok_per_s")
        out["peak_rss_mb"] = self.peak_rss_mb
        out["runs"] = len(self.runs)
        return out | self.info


def _spread(runs: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in runs if r.get(key)]
    if len(vals) < 2:
        return None
    return round(100 * (max(vals) - min(vals)) / statistics.median(vals), 1)


# ---- memory -----------------------------------------------------------------------------
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


def bytes_per_token(model_path: Path) -> dict[str, int]:
    """Weight bytes one decode step reads: every initializer, except tables only gathered from
    (embedding: one row per token). Read from the graph, not the config, so fusions and
    quantized layouts are counted as they ship."""
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
    for node in proto.graph.node:
        for idx, name in enumerate(node.input):
            if name in sizes:
                uses.setdefault(name, []).append((node.op_type, idx))
    total = gathered = 0
    for name, size in sizes.items():
        only_gather = uses.get(name) and all((op, i) in GATHERED for op, i in uses[name])
        if only_gather:
            gathered += size
            total += rows[name]
        else:
            total += size
    return {"weights": total, "gather_tables": gathered, "all_initializers": sum(sizes.values())}


def kv_bytes_per_token(manifest: art.Manifest, avg_length: float, batch: int) -> int:
    """KV bytes one decode step reads for `batch` rows at average cache length `avg_length`."""
    kv = manifest.kv
    per_pos = sum(
        h * (k + v) * np.dtype(dt).itemsize
        for h, k, v, dt in zip(kv.num_heads, kv.key_dim, kv.value_dim, kv.dtypes())
    )
    return int(per_pos * avg_length * batch)


# ---- prompts and our engine -------------------------------------------------------------
def make_prompts(config: BenchConfig, vocab: int) -> list[list[int]]:
    if config.prompt_ids:
        return [list(config.prompt_ids) for _ in range(config.batch)]
    rng = np.random.default_rng(config.seed)
    low = min(3, vocab - 1)  # skip the usual special ids (pad/bos/eos)
    return [rng.integers(low, vocab, size=config.prompt_len).tolist() for _ in range(config.batch)]


@dataclass
class Engine:
    """A warmed-up engine: `once()` runs one generation and returns its metrics."""

    name: str
    once: Callable[[], dict[str, Any]]
    result: EngineResult
    close: Callable[[], None] = lambda: None


def warm_engine(
    name: str,
    load: Callable[[], tuple[Callable[[], dict[str, Any]], dict[str, Any]]],
    warmup: int = 1,
) -> Engine:
    """Load and warm up one engine; its peak RSS is the process high-water mark from just before
    its load through its warm-up (so it includes what was already resident)."""
    reset_peak_rss()
    once, info = load()
    for _ in range(warmup):
        once()
    result = EngineResult(name, info=info)
    result.peak_rss_mb = peak_rss_mb()
    return Engine(name, once, result)


def specport_loader(
    artifact: Path, prompts: Sequence[Sequence[int]], config: BenchConfig
) -> Callable[[], Any]:
    def load() -> tuple[Callable[[], dict[str, Any]], dict[str, Any]]:
        from specport.runtime.generator import Generator
        from specport.runtime.kv.layouts import check_runtime_dtype
        from specport.runtime.session import SessionConfig, artifact_graph, make_session

        manifest = art.read_manifest(artifact)
        check_runtime_dtype(manifest, artifact)
        graph, entries = artifact_graph(artifact, manifest, mtp_branch=False)  # plain decoding
        sc = SessionConfig(
            provider=config.provider,
            intra_op_threads=config.threads,
            allow_spinning=config.allow_spinning,
            config_entries=entries,
        )
        session, used = make_session(graph, sc)
        gen = Generator(session, manifest)

        def once() -> dict[str, Any]:
            return gen.generate(prompts, config.new_tokens, eos_ids=()).metrics

        return once, {"provider": used, "kv_layout": manifest.kv.layout, "session": sc.describe()}

    return load


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


def _match_openmp_waiting(config: BenchConfig) -> None:
    """Give PyTorch (and the genai builder's torch) the same no-spin choice as onnxruntime.

    OpenMP threads busy-wait by default; on an oversubscribed machine torch with 2 threads was
    8x slower than with 1 (measured). The policy is read when libgomp loads, hence before torch.
    """
    from specport.runtime.session import SessionConfig

    if SessionConfig(allow_spinning=config.allow_spinning).resolved_spinning():
        return
    if "torch" in sys.modules:
        logger.warning(
            "torch already imported; OMP_WAIT_POLICY=PASSIVE cannot apply to the transformers peer"
        )
        return
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def compare(ours: dict[str, Any], peer: dict[str, Any]) -> dict[str, float | None]:
    """Speedup of ours over a peer per metric (>1 = ours better), from medians."""
    out: dict[str, float | None] = {}
    for key in TIME_KEYS:
        a, b = ours.get(key), peer.get(key)
        out[key] = round(b / a, 3) if a and b else None
    for key in RATE_KEYS:
        a, b = ours.get(key), peer.get(key)
        out[key] = round(a / b, 3) if a and b else None
    return out


def run_bench(
    artifact: str | os.PathLike[str],
    config: BenchConfig,
    peers: Sequence[str] = (),
    progress: bool | None = None,
) -> dict[str, Any]:
    """Everything `specport bench` prints, as one JSON-able dict.

    Engines run interleaved (run 1 of each, then run 2 of each, ...; the order rotates every
    round) with a bandwidth sample per round, so a shared machine's changing load and cache
    state hit all of them alike; speedups are medians of per-round ratios.
    """
    from specport.runtime.bench import peers as peer_mod
    from specport.runtime.session import SessionConfig

    path = Path(artifact)
    manifest = art.read_manifest(path)
    # Decide spinning once, so every engine runs under the same choice.
    config.allow_spinning = SessionConfig(allow_spinning=config.allow_spinning).resolved_spinning()
    _match_openmp_waiting(config)
    prompts = make_prompts(config, manifest.vocab_size)
    config.prompt_len = len(prompts[0])
    engines = [warm_engine("specport", specport_loader(path, prompts, config))]
    for name in peers:
        if name.startswith(peer_mod.SPECPORT_PEER):  # another artifact, same loop and prompts
            other = Path(name[len(peer_mod.SPECPORT_PEER) :])
            engines.append(warm_engine(name, specport_loader(other, prompts, config)))
            continue
        peer = peer_mod.make_peer(name, manifest, config, progress=progress)

        def load(p: Any = peer) -> tuple[Callable[[], dict[str, Any]], dict[str, Any]]:
            return (lambda: p.run(prompts, config.new_tokens)), p.info()

        engine = warm_engine(name, load)
        engine.close = peer.close
        engines.append(engine)
    weights = bytes_per_token(path / manifest.model_file)
    samples = []
    for i in range(config.runs):
        shift = i % len(engines)  # rotate the order: no engine always runs first (cold caches)
        for engine in engines[shift:] + engines[:shift]:
            cpu0 = _cpu_seconds()
            metrics = dict(engine.once())
            tokens = config.batch * config.new_tokens
            metrics["cpu_ms_per_token"] = round((_cpu_seconds() - cpu0) * 1e3 / tokens, 4)
            logger.info(
                "%s run %d: %s",
                engine.name,
                i + 1,
                {k: metrics.get(k) for k in (*TIME_KEYS, *RATE_KEYS)},
            )
            engine.result.runs.append(metrics)
        samples.append(
            measure_bandwidth(weights["all_initializers"], repeats=3, threads=config.threads)
        )
    for engine in engines[1:]:
        engine.close()
    # After the rounds, not between them: a third session sampled between rounds slowed the
    # engine that ran next by a few percent.
    kernels = _kernel_floor(path / manifest.model_file, manifest, config)
    if kernels is not None:
        for _ in range(config.runs):
            kernels.sample()
    hardware = hardware_floor(manifest, config, weights, samples)
    if kernels is not None:
        hardware["kernel_floor"] = kernels.summary()
        kernels.close()
    ours = engines[0].result
    report: dict[str, Any] = {
        "artifact": str(path),
        "config": {k: v for k, v in vars(config).items() if k != "prompt_ids"},
        "engines": {"specport": ours.summary()},
        "hardware": hardware,
    }
    floors = [s["floor_tpot_ms"] for s in hardware["per_run"]]
    ratios = [r["tpot_ms"] / f for r, f in zip(ours.runs, floors) if r.get("tpot_ms")]
    report["engines"]["specport"]["tpot_vs_floor"] = (
        round(statistics.median(ratios), 3) if ratios else None
    )
    for engine in engines[1:]:
        summary = engine.result.summary()
        summary["specport_speedup"] = paired_speedup(ours.runs, engine.result.runs)
        report["engines"][engine.name] = summary
    floor_ms = hardware.get("kernel_floor", {}).get("median_ms")
    for summary in report["engines"].values():
        tpot = summary.get("tpot_ms")
        summary["tpot_vs_kernel_floor"] = round(tpot / floor_ms, 3) if tpot and floor_ms else None
    return report


ONNXRUNTIME_PEERS = ("onnxruntime-genai",)  # peers whose steps run onnxruntime's kernels


def _kernel_floor(model_path: Path, manifest: art.Manifest, config: BenchConfig) -> Any:
    """The artifact's weight kernels alone (runtime/bench/kernel_floor.py), CPU only; None elsewhere.

    Decode runs them once per step at batch `config.batch`; nothing built on onnxruntime can
    step faster than they run, which bounds every speedup over a peer on the same kernels."""
    from specport.api import artifact_session_entries
    from specport.runtime.bench.kernel_floor import KernelFloor

    if config.provider not in ("auto", "cpu"):
        return None
    try:
        return KernelFloor(
            model_path,
            threads=config.threads,
            rows=config.batch,
            session_config=artifact_session_entries(manifest),
        )
    except Exception as exc:  # an op or dtype the standalone graph cannot rebuild: skip the line
        logger.warning("kernel floor not measured: %s", exc)
        return None


def _cpu_seconds() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return float(r.ru_utime + r.ru_stime)


def paired_speedup(
    ours: list[dict[str, Any]], peer: list[dict[str, Any]]
) -> dict[str, float | None]:
    """Median over rounds of ours-vs-peer speedup (>1 = ours better) per metric."""
    per_round = [compare(a, b) for a, b in zip(ours, peer)]
    out: dict[str, float | None] = {}
    for key in (*TIME_KEYS, *RATE_KEYS):
        vals = [v for r in per_round if (v := r[key]) is not None]
        out[key] = round(statistics.median(vals), 3) if vals else None
    return out


def format_table(report: dict[str, Any]) -> str:
    """One table: a row per metric, a column per engine, and ours-vs-peer speedups."""
    engines = report["engines"]
    names = list(engines)
    rows = [
        ("ttft_ms", "TTFT ms"),
        ("tpot_ms", "TPOT ms"),
        ("decode_tok_per_s", "decode tok/s"),
        ("prefill_tok_per_s", "prefill tok/s"),
        ("framework_overhead_pct", "overhead %"),
        ("peak_rss_mb", "peak RSS MB"),
        ("cpu_ms_per_token", "CPU ms/token"),
        ("spread_pct", "decode spread %"),
    ]
    header = ["metric", *names, *[f"specport/{n}" for n in names[1:]]]
    lines = [header]
    for key, label in rows:
        line = [label] + [_fmt(engines[n].get(key)) for n in names]
        for n in names[1:]:
            line.append(_fmt(engines[n].get("specport_speedup", {}).get(key), "x"))
        lines.append(line)
    widths = [max(len(str(r[i])) for r in lines) for i in range(len(header))]
    text = "\n".join(
        "  ".join(
            str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths))
        )
        for r in lines
    )
    hw = report["hardware"]
    cfg = report["config"]
    text += (
        f"\n\nbatch {cfg['batch']}, prompt {cfg['prompt_len']}, new {cfg['new_tokens']}, runs {cfg['runs']} "
        f"(medians; speedup = median of per-round ratios, > 1 = specport better)\n"
        f"bytes per decode step: weights {hw['weight_bytes_per_step'] / 1e6:.1f} MB + KV "
        f"{hw['kv_bytes_per_step'] / 1e6:.2f} MB; bandwidth ({hw['bandwidth'].get('method')}, "
        f"{hw['bandwidth']['buffer_mb']} MB) "
        f"median {hw['bandwidth']['median_gb_s']} GB/s, best {hw['bandwidth']['best_gb_s']} GB/s\n"
        f"bandwidth floor: TPOT {hw['floor_tpot_ms']} ms ({hw['floor_decode_tok_per_s']} tok/s); "
        f"specport TPOT / floor = {engines['specport'].get('tpot_vs_floor')}; load average {hw['load_average']}"
    )
    kernel = hw.get("kernel_floor")
    if kernel and kernel.get("median_ms"):
        text += (
            f"\nkernel floor: {kernel['median_ms']} ms per step ({kernel['method']}, "
            f"{kernel['weight_bytes'] / 1e6:.1f} MB); TPOT / kernel floor: "
            + ", ".join(f"{n} {engines[n].get('tpot_vs_kernel_floor')}" for n in names)
        )
        for n in names[1:]:
            peer_tpot = engines[n].get("tpot_ms")
            if peer_tpot and n in ONNXRUNTIME_PEERS:  # the bound holds for onnxruntime's kernels
                text += (
                    f"\nthe most any runtime on these kernels could gain over {n} here: "
                    f"{peer_tpot / kernel['median_ms']:.2f}x"
                )
    if hw.get("weights_fit_in_cache"):
        text += (
            f"\nnote: the bytes of a step fit in the last-level cache "
            f"({hw['last_level_cache_bytes'] / 2**20:.0f} MiB), so they are read from cache, "
            "not DRAM: the floor above is measured over the same buffer size and is a cache floor"
        )
    return text


def _fmt(value: Any, suffix: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}{suffix}" if abs(value) < 100 else f"{value:.1f}{suffix}"
    return f"{value}{suffix}"
