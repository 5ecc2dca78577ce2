"""Decode speed of specport's 4-bit default beside the peers' 4-bit files (issue 44).

Issue 44 asks that specport's 4-bit default decode at least as fast as onnxruntime-genai int4,
OpenVINO GenAI int4 and llama.cpp at the same bits per weight, at batch 1 and 8, with 2
threads, on the same prompts. `specport bench --peer` cannot answer that: its peers are built
from the artifact (one genai precision, no k_quant build, no OpenVINO batch, llama.cpp through
llama-cpp-python at batch 1 only). This script times prebuilt files instead, one engine per
kind, in alternating rounds (each round runs every engine at every batch; the order rotates),
and prints one table: bits per weight over the whole file, decode tok/s at each batch, the
median per-round ratio to the first engine (specport's default), and process CPU seconds per
decoded token, with the CPU flags and the load average of each round.

Engines (`KIND:PATH`):
- `specport:DIR`  an artifact, run by specport's Generator (plain greedy, EOS ignored);
- `genai:DIR`     an onnxruntime-genai folder (its model builder's output);
- `openvino:DIR`  an OpenVINO IR folder run by OpenVINO GenAI's LLMPipeline in the venv that
                  `specport bench --peer openvino-genai` creates (OpenVINO's own CPU defaults:
                  what its users get; INFERENCE_NUM_THREADS = --threads);
- `llama:GGUF`    llama.cpp's `llama-batched-bench` from --llama-bin (random prompt ids of the
                  same length; llama.cpp's own timers).

How decode is measured. Decode is everything after the first new token (the prefill's); tok/s
is batch x steps over its wall time. specport, genai and OpenVINO at batch 1 stamp the first
token and read the process CPU clock there and at the end. OpenVINO GenAI streams only one row,
so at batch > 1 its decode time and CPU are a run of N new tokens minus a run of 1 on the same
prompts. llama-batched-bench reports its own decode time (T_TG) and runs in a child process:
its decode CPU is the child's CPU for N new tokens minus a child run with 1 (load, warm-up and
prefill cancel). Bits per weight are the model files' bytes x 8 over the fp32 export's parameter
count (core/weight_size.py's count, the tied embedding once); ONNX rows add core/weight_size.py's
tensor-only figure.

Files (`prepare` builds the missing ones, about 6 minutes; all under --dir, default
../artifacts): qspeed-w4a8 (`specport quantize smollm --scheme w4a8`: the README's 4-bit
default; no --calib, so HQQ and an 8-bit head), qspeed-w4a8-head4 (the same, --lm-head-bits 4),
qspeed-genai-int4 / qspeed-genai-kqmixed (onnxruntime-genai's builder, -p int4, RTN and
algo_config=k_quant_mixed), qspeed-ov-int4 (optimum-cli --weight-format int4 --group-size 64:
nncf's int4 defaults) / qspeed-ov-int4-awq (the same plus AWQ and scale estimation on 128
documents of benchmarks/calib_mix.py's text), qspeed-Q4_0.gguf / qspeed-Q4_K_M.gguf
(llama-quantize --allow-requantize from the shared Q4_1 GGUF). It needs smollm and smollm-hf
there, OpenVINO GenAI's venv (created on first use) and llama.cpp's llama-quantize and
llama-batched-bench in --llama-bin (default ../peers/llama.cpp/build/bin):

    python -m benchmarks.quant_speed_peers prepare

The timed run, in a quiet window (nothing else on the cores: llama.cpp's spinning threads
collapse beside other jobs; a warning says so when the load average is high). One round at these
sizes took 44 s with all eight engines, loads and warm-ups included, so 8 rounds take about
5 minutes:

    python -m benchmarks.quant_speed_peers run --rounds 8 --prompt-len 128 --new-tokens 128 \\
        --batch 1 8 --threads 2 --json-out ../artifacts/qspeed-result.json

`run` without --engine takes every qspeed-* file of --dir, specport's default first (the
ratios' base). A smoke test: `run --rounds 1 --prompt-len 16 --new-tokens 8 --batch 1 2`
(llama.cpp's CPU per token is a difference of two child runs: meaningless at 8 tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from specport.artifact.manifest import MANIFEST_NAME
from specport.bench.peers import greedy_generator
from specport.core.settings import shared_dir

PARAMS_FALLBACK = 134_515_008  # SmolLM2-135M, the tied embedding once (the 2026-12-05 page)
GGUF_NAME = "models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"
FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile", "amx_int8")


@dataclass
class Decode:
    """One measured run: decode wall seconds, decode steps after the first token, rows, and the
    engine process's CPU seconds over the same decode (None when not measured)."""

    seconds: float
    steps: int
    batch: int
    cpu: float | None

    @property
    def tok_per_s(self) -> float:
        return self.batch * self.steps / max(self.seconds, 1e-9)

    @property
    def cpu_per_token(self) -> float | None:
        tokens = self.batch * self.steps
        return self.cpu / tokens if self.cpu is not None and tokens else None


@dataclass
class Row:
    """An engine's label, files and runs per batch."""

    label: str
    kind: str
    path: Path
    file_bytes: int
    tensor_bpw: float | None = None
    runs: dict[int, list[Decode]] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return float(r.ru_utime + r.ru_stime)


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return float(r.ru_utime + r.ru_stime)


# ---------------------------------------------------------------- engines


class SpecportEngine:
    """A specport artifact through the Generator `specport bench` and `generate` use."""

    def __init__(self, path: Path, threads: int, spin: bool) -> None:
        from specport.artifact import manifest as art
        from specport.runtime.generator import Generator
        from specport.runtime.session import SessionConfig, artifact_graph, make_session

        manifest = art.read_manifest(path)
        graph, entries = artifact_graph(path, manifest, mtp_branch=False)
        sc = SessionConfig(intra_op_threads=threads, allow_spinning=spin, config_entries=entries)
        session, provider = make_session(graph, sc)
        self.gen = Generator(session, manifest)
        self.info = {"scheme": (manifest.quant or {}).get("scheme"), "provider": provider}

    def run(self, prompts: list[list[int]], new_tokens: int) -> Decode:
        first: list[tuple[float, float]] = []

        def on_token(row: int, token: int) -> bool:
            if not first:
                first.append((time.perf_counter(), _cpu()))
            return False

        self.gen.generate(prompts, new_tokens, eos_ids=(), on_token=on_token)
        t2, c2 = time.perf_counter(), _cpu()
        t1, c1 = first[0]
        return Decode(t2 - t1, new_tokens - 1, len(prompts), c2 - c1)

    def close(self) -> None:
        del self.gen


class GenaiEngine:
    """An onnxruntime-genai folder, with the session options `specport bench`'s genai peer sets."""

    def __init__(self, path: Path, threads: int, spin: bool) -> None:
        import onnxruntime_genai as og

        self.og = og
        cfg = og.Config(str(path))
        cfg.clear_providers()
        options = {
            "intra_op_num_threads": threads,
            "inter_op_num_threads": 1,
            "session.intra_op.allow_spinning": "1" if spin else "0",
            "session.inter_op.allow_spinning": "1" if spin else "0",
        }
        cfg.overlay(json.dumps({"model": {"decoder": {"session_options": options}}}))
        self.model = og.Model(cfg)
        self.info = {"version": getattr(og, "__version__", "?")}

    def run(self, prompts: list[list[int]], new_tokens: int) -> Decode:
        og = self.og
        ids = np.asarray(prompts, dtype=np.int32)
        batch, _ = ids.shape
        gen = greedy_generator(og, self.model, ids, new_tokens)
        gen.append_tokens(ids)  # prefill
        gen.generate_next_token()  # the first token, from the prefill's logits
        t1, c1 = time.perf_counter(), _cpu()
        steps = 0
        while not gen.is_done():
            gen.generate_next_token()
            steps += 1
        t2, c2 = time.perf_counter(), _cpu()
        del gen
        return Decode(t2 - t1, steps, batch, c2 - c1)

    def close(self) -> None:
        del self.model


class OpenVinoEngine:
    """OpenVINO GenAI's LLMPipeline in its own venv (peer_openvino's worker), OpenVINO's defaults."""

    def __init__(self, path: Path, threads: int, spin: bool) -> None:
        from specport.bench.peer_openvino import Worker, ensure_venv, load_properties

        self.worker = Worker(ensure_venv(progress=True))
        self.properties = load_properties("default", threads)
        loaded = self.worker.call(
            {"op": "load", "model": str(path), "mode": "plain", "properties": self.properties}
        )
        self.info = {"properties": self.properties, **(loaded.get("versions") or {})}

    def _call(self, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
        ids: Any = prompts[0] if len(prompts) == 1 else prompts
        return self.worker.call({"op": "run", "ids": ids, "new_tokens": new_tokens})

    def run(self, prompts: list[list[int]], new_tokens: int) -> Decode:
        full = self._call(prompts, new_tokens)
        if len(prompts) == 1:  # the streamer stamped the first token
            seconds = float(full["t_end"]) - float(full["t_first"])
            cpu = float(full["c_end"]) - float(full["c_first"])
            return Decode(seconds, int(full["writes"]) - 1, 1, cpu)
        one = self._call(prompts, 1)  # no streamer for several rows: subtract the prefill run

        def span(a: dict[str, Any], start: str, end: str) -> float:
            return float(a[end]) - float(a[start])

        seconds = span(full, "t_start", "t_end") - span(one, "t_start", "t_end")
        cpu = span(full, "c_start", "c_end") - span(one, "c_start", "c_end")
        return Decode(seconds, new_tokens - 1, len(prompts), cpu)

    def close(self) -> None:
        self.worker.close()


class LlamaEngine:
    """llama.cpp's llama-batched-bench on a GGUF, one child process per measurement."""

    def __init__(
        self, path: Path, threads: int, spin: bool, bin_dir: Path, extra: Sequence[str]
    ) -> None:
        self.exe = bin_dir / "llama-batched-bench"
        if not self.exe.is_file():
            raise SystemExit(
                f"{self.exe} is missing: cmake --build {bin_dir.parent} --target "
                "llama-batched-bench (a few minutes once llama.cpp's libraries are built)"
            )
        self.path, self.threads, self.extra = path, threads, list(extra)
        self.info = {"exe": str(self.exe), "args": self.extra}

    def _child(self, plen: int, batch: int, new_tokens: int) -> tuple[dict[str, Any], float]:
        cmd = [
            str(self.exe), "-m", str(self.path), "-c", str(batch * (plen + new_tokens) + 16),
            "-b", "2048", "-ub", "512", "-npp", str(plen), "-ntg", str(new_tokens),
            "-npl", str(batch), "-t", str(self.threads), "-tb", str(self.threads),
            "--output-format", "jsonl", *self.extra,
        ]  # fmt: skip
        c0 = _children_cpu()
        out = subprocess.run(cmd, capture_output=True, text=True, check=False)
        cpu = _children_cpu() - c0
        rows = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
        rows += [json.loads(x) for x in out.stderr.splitlines() if x.startswith("{")]
        if out.returncode != 0 or not rows:
            tail = (out.stderr or out.stdout).strip().splitlines()[-3:]
            raise RuntimeError(f"llama-batched-bench failed ({out.returncode}): {tail}")
        return rows[-1], cpu

    def run(self, prompts: list[list[int]], new_tokens: int) -> Decode:
        batch, plen = len(prompts), len(prompts[0])
        full, cpu_full = self._child(plen, batch, new_tokens)
        _, cpu_one = self._child(plen, batch, 1)
        # T_TG covers `new_tokens` decode steps after the prefill; the CPU difference
        # new_tokens - 1 of them (the child with 1 new token runs one step too).
        steps = new_tokens
        seconds = float(full["t_tg"])
        cpu_steps = (cpu_full - cpu_one) * steps / max(new_tokens - 1, 1)
        return Decode(seconds, steps, batch, cpu_steps)

    def close(self) -> None:
        pass


# ---------------------------------------------------------------- files


def file_bytes(kind: str, path: Path) -> int:
    """The bytes a user downloads to run the model (graph, weights; no tokenizer)."""
    if kind == "llama":
        return path.stat().st_size
    if kind == "openvino":
        return sum((path / f).stat().st_size for f in ("openvino_model.xml", "openvino_model.bin"))
    if kind == "specport":
        from specport.artifact import manifest as art

        graph = path / art.read_manifest(path).model_file
    else:
        graph = path / "model.onnx"
    return graph.stat().st_size + sum(
        p.stat().st_size for p in graph.parent.glob(graph.name + ".data*")
    )


def tensor_bpw(kind: str, path: Path) -> tuple[float | None, int | None]:
    """core/weight_size.py's bits per weight and parameter count for ONNX rows."""
    from specport.core.weight_size import artifact_weight_size, model_weight_size

    if kind == "specport":
        from specport.artifact import manifest as art

        size = artifact_weight_size(path, art.read_manifest(path))
    elif kind == "genai":
        size = model_weight_size(path / "model.onnx")
    else:
        return None, None
    return size.bits_per_weight, size.params


def default_engines(root: Path) -> list[str]:
    """Every file `prepare` makes under `root`, in table order (specport's default first)."""
    wanted = [
        ("specport", "qspeed-w4a8"),
        ("specport", "qspeed-w4a8-head4"),
        ("genai", "qspeed-genai-int4"),
        ("genai", "qspeed-genai-kqmixed"),
        ("openvino", "qspeed-ov-int4"),
        ("openvino", "qspeed-ov-int4-awq"),
        ("llama", "qspeed-Q4_0.gguf"),
        ("llama", "qspeed-Q4_K_M.gguf"),
    ]
    found = [f"{kind}:{root / name}" for kind, name in wanted if (root / name).exists()]
    if not found or not found[0].startswith("specport:"):
        raise SystemExit(f"no {root}/qspeed-w4a8: run `prepare` first (or name the engines)")
    return found


def make_engine(kind: str, path: Path, args: argparse.Namespace) -> Any:
    if kind == "specport":
        return SpecportEngine(path, args.threads, args.spin)
    if kind == "genai":
        return GenaiEngine(path, args.threads, args.spin)
    if kind == "openvino":
        return OpenVinoEngine(path, args.threads, args.spin)
    if kind == "llama":
        return LlamaEngine(path, args.threads, args.spin, Path(args.llama_bin), args.llama_arg)
    raise SystemExit(f"unknown engine kind {kind!r}: specport, genai, openvino or llama")


# ---------------------------------------------------------------- the machine


def cpu_line() -> str:
    """The CPU model and the SIMD flags that decide which kernels each engine picks."""
    model, flags = platform.processor() or "?", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    have = [f for f in FLAGS if f in flags]
    return f"{model}; {os.cpu_count()} logical CPUs; flags: {' '.join(have) or 'none of ' + str(FLAGS)}"


def load_avg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# ---------------------------------------------------------------- run


def run(args: argparse.Namespace) -> int:
    root = Path(args.dir)
    specs = args.engines or default_engines(root)
    if args.spin is None:
        from specport.runtime.session import SessionConfig

        args.spin = SessionConfig(allow_spinning=None).resolved_spinning()
    rows: list[Row] = []
    engines: list[Any] = []
    params: int | None = None
    for spec in specs:
        kind, _, p = spec.partition(":")
        path = Path(p)
        label = f"{kind}:{path.name}"
        t0 = time.perf_counter()
        engine = make_engine(kind, path, args)
        bpw, n = tensor_bpw(kind, path)
        params = params or n
        row = Row(label, kind, path, file_bytes(kind, path), bpw, info=dict(engine.info))
        print(f"[load] {label} in {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
        rows.append(row)
        engines.append(engine)
    params = params or PARAMS_FALLBACK
    rng = np.random.default_rng(args.seed)
    prompts = {
        b: rng.integers(3, args.vocab, size=(b, args.prompt_len)).tolist() for b in args.batch
    }
    for engine in engines:  # one warm-up per engine and batch (llama.cpp warms up itself)
        for b in args.batch if not isinstance(engine, LlamaEngine) else ():
            engine.run(prompts[b], min(args.new_tokens, 4))
    loads = [load_avg()]
    if os.getloadavg()[0] > 0.5 * (os.cpu_count() or 1):
        print(
            f"[warning] load average {loads[0]} before the rounds: llama.cpp's spinning threads "
            "collapse on a busy machine (2 threads beside 2 other jobs: 5.6 against 175 tok/s "
            "with 1 thread, measured); time in a quiet window",
            file=sys.stderr,
        )
    for r in range(args.rounds):
        shift = r % len(engines)
        order = list(zip(engines, rows))
        order = order[shift:] + order[:shift]
        for b in args.batch:
            for engine, row in order:
                d = engine.run(prompts[b], args.new_tokens)
                row.runs.setdefault(b, []).append(d)
                print(
                    f"[round {r + 1}] {row.label} batch {b}: {d.tok_per_s:.1f} tok/s"
                    f" (load {load_avg()})",
                    file=sys.stderr,
                    flush=True,
                )
        loads.append(load_avg())
    for engine in engines:
        engine.close()
    report = summarize(rows, args, params, loads)
    print(format_table(report))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


def summarize(
    rows: list[Row], args: argparse.Namespace, params: int, loads: list[str]
) -> dict[str, Any]:
    """Medians over rounds; ratios are medians of per-round ratios to the first row."""
    base = rows[0]
    out: list[dict[str, Any]] = []
    for row in rows:
        entry: dict[str, Any] = {
            "engine": row.label,
            "path": str(row.path),
            "file_mb": round(row.file_bytes / 1e6, 1),
            "bpw_file": round(8 * row.file_bytes / params, 2),
            "bpw_tensors": round(row.tensor_bpw, 2) if row.tensor_bpw else None,
            "info": row.info,
        }
        for b, runs in row.runs.items():
            ratios = [d.tok_per_s / o.tok_per_s for d, o in zip(runs, base.runs[b])]
            cpus = [c for c in (d.cpu_per_token for d in runs) if c is not None]
            entry[f"batch{b}"] = {
                "tok_per_s": round(statistics.median(d.tok_per_s for d in runs), 2),
                "ratio_to_first": round(statistics.median(ratios), 3),
                "cpu_s_per_token": round(statistics.median(cpus), 5) if cpus else None,
                "runs_tok_per_s": [round(d.tok_per_s, 2) for d in runs],
            }
        out.append(entry)
    return {
        "config": {
            k: getattr(args, k)
            for k in ("prompt_len", "new_tokens", "batch", "threads", "rounds", "seed", "spin")
        },
        "cpu": cpu_line(),
        "load_average_per_round": loads,
        "params": params,
        "rows": out,
    }


def format_table(report: dict[str, Any]) -> str:
    batches = report["config"]["batch"]
    head = ["engine", "bpw file", "bpw tensors"]
    for b in batches:
        head += [f"tok/s b{b}", f"x first b{b}", f"CPU s/tok b{b}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in report["rows"]:
        cells = [r["engine"], f"{r['bpw_file']:.2f}", f"{r['bpw_tensors'] or '':}"]
        for b in batches:
            m = r.get(f"batch{b}", {})
            cpu = m.get("cpu_s_per_token")
            cells += [
                f"{m.get('tok_per_s', '')}",
                f"{m.get('ratio_to_first', '')}",
                f"{cpu:.4f}" if cpu is not None else "",
            ]
        lines.append("| " + " | ".join(cells) + " |")
    c = report["config"]
    lines += [
        "",
        f"prompt {c['prompt_len']} random ids, {c['new_tokens']} new tokens, greedy, "
        f"{c['threads']} threads, spinning {c['spin']}, {c['rounds']} alternating round(s); "
        f"bpw over {report['params']:,} parameters",
        f"CPU: {report['cpu']}",
        f"load average (1/5/15 min) before and after each round: {report['load_average_per_round']}",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------- prepare


def _step(name: str, out: Path, cmd: list[str]) -> None:
    if out.exists():
        print(f"[prepare] {out} exists", file=sys.stderr)
        return
    print(f"[prepare] {name}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True)
    print(f"[prepare] {name} done in {time.perf_counter() - t0:.0f}s", file=sys.stderr)


# Runs in OpenVINO GenAI's venv: nncf int4 (optimum-intel's int4 defaults: asymmetric, ratio
# 1.0, int8 backup for the embedding) plus AWQ and scale estimation on the first N documents of
# the calibration mix (no WikiText: the perplexity rows are scored on it); group 64 (576 = 9 x 64).
_OV_AWQ = """
import sys
from optimum.intel import OVModelForCausalLM, OVWeightQuantizationConfig
hf, out, calib, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
docs = [d.strip() for d in open(calib).read().split("\\n\\n") if d.strip()][:n]
q = OVWeightQuantizationConfig(bits=4, sym=False, group_size=64, ratio=1.0, dataset=docs,
    tokenizer=hf, num_samples=n, quant_method="awq", scale_estimation=True)
OVModelForCausalLM.from_pretrained(hf, export=True, quantization_config=q).save_pretrained(out)
"""


def prepare(args: argparse.Namespace) -> int:
    """Build every missing file of the default engine list (about 6 minutes on the loaded
    2-core machine: specport 1 min each, genai RTN 1 min, k_quant_mixed 2-3 min, OpenVINO int4
    1.5 min, its AWQ 1 min, the GGUFs seconds)."""
    root = Path(args.dir)
    src, hf = root / "smollm", root / "smollm-hf"
    gguf = Path(args.gguf or Path(args.shared) / GGUF_NAME)
    if not gguf.is_file():
        raise SystemExit(
            f"no source GGUF at {gguf}: pass --gguf, or --shared / SPECPORT_SHARED for the "
            "shared data folder"
        )
    if not (src / MANIFEST_NAME).is_file():
        raise SystemExit(f"no artifact at {src}: specport export {gguf} --out {src}")
    py = sys.executable
    if not hf.exists():
        _step("HF folder", hf, [py, "-m", "benchmarks.serve_vs_vllm", "hf-dir", str(src), str(hf)])
    quantize = ["specport", "quantize", str(src), "--scheme", "w4a8", "--out"]
    _step("specport 4-bit default", root / "qspeed-w4a8", [*quantize, str(root / "qspeed-w4a8")])
    out = root / "qspeed-w4a8-head4"
    _step("specport w4a8, 4-bit head", out, [*quantize, str(out), "--lm-head-bits", "4"])
    cache = root / "qspeed-cache"
    builder = [py, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-c", str(cache)]
    builder += ["-p", "int4", "-e", "cpu", "-o"]
    out = root / "qspeed-genai-int4"
    _step("genai int4 RTN", out, [*builder, str(out)])
    out = root / "qspeed-genai-kqmixed"
    kquant = ["--extra_options", "algo_config=k_quant_mixed"]
    _step("genai int4 k_quant_mixed", out, [*builder, str(out), *kquant])
    shutil.rmtree(cache, ignore_errors=True)

    from specport.bench.peer_openvino import ensure_venv, export_command

    python = ensure_venv(progress=True)
    plain = root / "qspeed-ov-int4"
    optimum = python.parent / "optimum-cli"
    _step("OpenVINO int4 (nncf defaults)", plain, export_command(optimum, hf, plain, "int4"))
    calib = root / "qspeed-calib_mix.txt"
    mix = [py, "-m", "benchmarks.calib_mix", "--shared", args.shared, "--docs", "docs"]
    _step("calibration mix", calib, [*mix, "--out", str(calib)])
    out = root / "qspeed-ov-int4-awq"
    if not out.exists():
        cmd = [str(python), "-c", _OV_AWQ, str(hf), str(out), str(calib), "128"]
        _step("OpenVINO int4, AWQ + scale estimation", out, cmd)
        for f in plain.glob("openvino_*tokenizer.*"):
            shutil.copy(f, out / f.name)  # LLMPipeline reads them; this export writes none
    bin_dir = Path(args.llama_bin)
    for t in ("Q4_0", "Q4_K_M"):
        out = root / f"qspeed-{t}.gguf"
        cmd = [str(bin_dir / "llama-quantize"), "--allow-requantize", str(gguf), str(out), t, "2"]
        _step(f"llama.cpp {t}", out, cmd)
    if not (bin_dir / "llama-batched-bench").is_file():
        print(
            f"[prepare] missing {bin_dir}/llama-batched-bench: "
            f"cmake --build {bin_dir.parent} --target llama-batched-bench",
            file=sys.stderr,
        )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--dir", default="../artifacts", help="where the qspeed-* files live")
    common.add_argument("--llama-bin", default="../peers/llama.cpp/build/bin")
    r = sub.add_parser("run", parents=[common], help="time the engines")
    r.add_argument("--engine", dest="engines", action="append", metavar="KIND:PATH",
                   help="repeatable; the first is the ratios' base (default: every qspeed-* "
                   "file in --dir, specport's default first)")  # fmt: skip
    r.add_argument("--rounds", type=int, default=3)
    r.add_argument("--prompt-len", type=int, default=128)
    r.add_argument("--new-tokens", type=int, default=128)
    r.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    r.add_argument("--threads", type=int, default=2)
    r.add_argument("--spin", action=argparse.BooleanOptionalAction, default=None,
                   help="onnxruntime thread spinning (default: specport's auto choice)")  # fmt: skip
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--vocab", type=int, default=49152, help="prompt ids are drawn below this")
    r.add_argument("--llama-arg", action="append", default=[],
                   help="extra llama-batched-bench argument, e.g. --llama-arg=--no-repack")  # fmt: skip
    r.add_argument("--json-out", help="also write the report here")
    p = sub.add_parser("prepare", parents=[common], help="build the missing files")
    p.add_argument(
        "--shared", default=str(shared_dir()), help="the shared data folder (SPECPORT_SHARED)"
    )
    p.add_argument("--gguf", help="the source GGUF (default: the shared SmolLM2 Q4_1)")
    args = ap.parse_args(argv)
    return run(args) if args.cmd == "run" else prepare(args)


if __name__ == "__main__":
    sys.exit(main())
