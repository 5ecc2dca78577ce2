"""Benchmark an artifact: latency/throughput, overhead, memory, and how far it is from the hardware.

This module is the run loop: load and warm each engine (ours, peers from peers.py, other
artifacts), run them interleaved on the same prompts, then measure the floors (hardware.py,
kernel_floor.py) and combine everything into one report (results.py; report.py prints it).
Peers (onnxruntime-genai, llama.cpp, transformers) run in this process, on the same prompts,
with the same thread count, after ours; every engine gets a warm-up run first.
"""

from __future__ import annotations

import logging
import os
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from specport.artifact import manifest as art
from specport.bench import peers as peer_mod
from specport.bench.hardware import (
    bytes_per_token,
    hardware_floor,
    measure_bandwidth,
    peak_rss_mb,
    reset_peak_rss,
)
from specport.bench.kernel_floor import KernelFloor
from specport.bench.results import (
    RATE_KEYS,
    TIME_KEYS,
    BenchConfig,
    EngineResult,
    paired_speedup,
)
from specport.runtime.generator import Generator
from specport.runtime.kv.layouts import check_runtime_dtype
from specport.runtime.session import (
    SessionConfig,
    artifact_graph,
    artifact_session_entries,
    make_session,
)

__all__ = ["Engine", "make_prompts", "run_bench", "specport_loader", "warm_engine"]

logger = logging.getLogger(__name__)


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
            gen.forget_prompt()  # TTFT and prefill tok/s of a read prompt, not a cache hit
            return gen.generate(prompts, config.new_tokens, eos_ids=()).metrics

        return once, {"provider": used, "kv_layout": manifest.kv.layout, "session": sc.describe()}

    return load


def _match_openmp_waiting(config: BenchConfig) -> None:
    """Give PyTorch (and the genai builder's torch) the same no-spin choice as onnxruntime.

    OpenMP threads busy-wait by default; on an oversubscribed machine torch with 2 threads was
    8x slower than with 1 (measured). The policy is read when libgomp loads, hence before torch.
    """

    if SessionConfig(allow_spinning=config.allow_spinning).resolved_spinning():
        return
    if "torch" in sys.modules:
        logger.warning(
            "torch already imported; OMP_WAIT_POLICY=PASSIVE cannot apply to the transformers peer"
        )
        return
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


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


def _kernel_floor(model_path: Path, manifest: art.Manifest, config: BenchConfig) -> Any:
    """The artifact's weight kernels alone (specport/bench/kernel_floor.py), CPU only; None elsewhere.

    Decode runs them once per step at batch `config.batch`; nothing built on onnxruntime can
    step faster than they run, which bounds every speedup over a peer on the same kernels."""

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
