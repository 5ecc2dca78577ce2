"""OpenVINO GenAI as a `specport bench` peer: plain greedy, prompt lookup and draft-model
speculation, on the same prompts and threads as specport.

OpenVINO GenAI is Intel's CPU inference engine with its own speculative decoding, so it is a
peer users weigh specport against. Three facts shape this module:

- **Its own virtual environment.** optimum-intel (the exporter) pins transformers and pulls
  torchvision unpinned, which drags in a CUDA torch; installed beside specport it would break
  specport's own environment. So OpenVINO GenAI lives in `venv_dir()` (created on first use,
  with progress), the conversion runs that venv's `optimum-cli`, and generation runs in a worker
  process (`openvino_worker.py`, JSON lines over stdin/stdout). specport never imports
  openvino_genai.
- **The same checkpoint, converted once.** The artifact's source model (its manifest records the
  path; a GGUF source is the HF directory specport's own importer writes) is exported with
  `optimum-cli export openvino --task text-generation-with-past --weight-format fp32|int8|int4`
  at the artifact's weight bit width, and cached by content like the other peers (peer_cache).
- **Two precision rows.** `openvino-genai` (or `:f32`) computes in exact fp32
  (`INFERENCE_PRECISION_HINT=f32`, `KV_CACHE_PRECISION=f32`): only then can its greedy tokens
  equal specport's. `openvino-genai:default` keeps OpenVINO's own defaults (bf16 compute and a
  u8 KV cache on CPUs with AVX512-BF16/AMX; f32 compute elsewhere), which is what its users get.

Peer names: `openvino-genai[:f32|:default][+lookup|+draft]`. `+lookup` is its prompt-lookup
decoding, `+draft` its draft-model speculation with the source model of `--draft ARTIFACT`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specport.artifact import manifest as art
from specport.bench.peer_base import genai_precision, peer_metrics, source_dir
from specport.bench.peer_cache import Entry, content_key, evict
from specport.core.errors import InputError, SpecportError
from specport.core.settings import cache_dir

logger = logging.getLogger(__name__)

NAME = "openvino-genai"
MODES = {"": "plain", "+lookup": "lookup", "+draft": "draft"}
# What each precision row sets on the CPU plugin (the draft model gets the same).
PRECISIONS: dict[str, dict[str, str]] = {
    "f32": {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"},
    "default": {},
}
LOOKUP_NGRAM = 3  # max_ngram_size of OpenVINO GenAI's own prompt-lookup sample
PACKAGES = ("openvino", "openvino-genai", "openvino-tokenizers", "optimum-intel[openvino]", "nncf")
READY = "specport-ready.json"  # written last: a venv without it is incomplete
WORKER = Path(__file__).with_name("openvino_worker.py")


@dataclass(frozen=True)
class PeerName:
    precision: str  # a key of PRECISIONS
    mode: str  # "plain" | "lookup" | "draft"


def parse_name(name: str) -> PeerName:
    """`openvino-genai[:f32|:default][+lookup|+draft]` -> (precision, mode), or a one-line error."""
    base, plus, suffix = name.partition("+")
    head, _, precision = base.partition(":")
    mode = MODES.get(plus + suffix)
    if head != NAME or mode is None or (precision or "f32") not in PRECISIONS:
        raise InputError(
            f"unknown peer {name!r}: OpenVINO GenAI peers are {NAME}[:f32|:default]"
            "[+lookup|+draft] (f32: exact fp32, the default; default: OpenVINO's own precision; "
            "+lookup: its prompt-lookup decoding; +draft: its draft-model speculation, with "
            "--draft ARTIFACT)."
        )
    return PeerName(precision or "f32", mode)


def is_openvino(name: str) -> bool:
    return name.partition(":")[0].partition("+")[0] == NAME


# ---------------------------------------------------------------- the virtual environment


def venv_dir() -> Path:
    """Where OpenVINO GenAI's own venv lives (`SPECPORT_OPENVINO_VENV` overrides)."""
    env = os.environ.get("SPECPORT_OPENVINO_VENV")
    return Path(env).expanduser() if env else cache_dir() / "venvs" / NAME


def venv_python(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def torch_pin() -> str:
    """The CPU torch specport itself runs on (the venv installs it first and keeps it: left
    unpinned, optimum-intel's torchvision pulls a CUDA torch and ~20 nvidia packages)."""
    from importlib import metadata

    try:
        version = metadata.version("torch").split("+")[0]
    except metadata.PackageNotFoundError:
        version = "2.13.0"
    return f"torch=={version}"


def setup_commands(venv: Path, constraints: Path) -> list[list[str]]:
    """The commands that create the venv (each step is shown as it runs)."""
    py = str(venv_python(venv))
    pip = [py, "-m", "pip", "install", "--disable-pip-version-check"]
    return [
        [sys.executable, "-m", "venv", str(venv)],
        [*pip, torch_pin()],
        [*pip, "-c", str(constraints), *PACKAGES],
        # not used by text export, and a CUDA build that cannot load beside the CPU torch
        [py, "-m", "pip", "uninstall", "-y", "torchvision"],
    ]


def setup_hint(venv: Path) -> str:
    """The shell command a user runs to create the venv by hand."""
    py = venv_python(venv)
    return (
        f"python -m venv {venv} && {py} -m pip install {torch_pin()} && "
        f"{py} -m pip install {' '.join(repr(p) if '[' in p else p for p in PACKAGES)} "
        f"'{torch_pin()}' && {py} -m pip uninstall -y torchvision && "
        f"echo '{{}}' > {venv / READY}"
    )


def ensure_venv(progress: bool | None = None) -> Path:
    """The venv's Python, creating the venv on first use (about a GB from the package index)."""
    venv = venv_dir()
    python = venv_python(venv)
    if python.exists() and (venv / READY).exists():
        return python
    show = sys.stderr.isatty() if progress is None else progress
    if venv.exists() and not (venv / READY).exists():
        _remove_venv(venv)  # an earlier creation that did not finish
    _say(show, f"[peer] creating OpenVINO GenAI's own environment in {venv} (once) ...")
    with tempfile.TemporaryDirectory() as tmp:
        constraints = Path(tmp) / "constraints.txt"
        constraints.write_text(torch_pin() + "\n")
        log = Path(tmp) / "setup.log"
        commands = setup_commands(venv, constraints)
        for i, cmd in enumerate(commands, 1):
            _say(show, f"[peer] step {i}/{len(commands)}: {' '.join(cmd[2:] or cmd)}")
            t0 = time.perf_counter()
            with open(log, "w") as out:
                rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode
            if rc != 0:
                tail = _last_line(log)
                _remove_venv(venv)
                raise SpecportError(
                    f"could not create OpenVINO GenAI's environment in {venv} ({tail}); with "
                    f"network access, create it by hand: {setup_hint(venv)}"
                )
            _say(show, f"[peer]   done in {time.perf_counter() - t0:.0f}s")
    (venv / READY).write_text(json.dumps(venv_versions(python), indent=1) + "\n")
    return python


def _remove_venv(venv: Path) -> None:
    """Delete a half-made venv: only ours (it has pyvenv.cfg and sits where venv_dir says)."""
    if venv == venv_dir() and (venv / "pyvenv.cfg").exists():
        shutil.rmtree(venv, ignore_errors=True)


def venv_versions(python: Path) -> dict[str, str]:
    """Versions of the packages that decide the conversion's bytes and the engine's speed."""
    code = (
        "import json, importlib.metadata as m\n"
        "v = {}\n"
        "for p in ('openvino', 'openvino-genai', 'optimum-intel', 'nncf', 'transformers', 'torch'):\n"
        "    try: v[p] = m.version(p)\n"
        "    except m.PackageNotFoundError: pass\n"
        "print(json.dumps(v))\n"
    )
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SpecportError(
            f"OpenVINO GenAI's environment {python.parent.parent} does not run "
            f"({_one_line(out.stderr)}); delete it and bench again to re-create it."
        )
    return dict(json.loads(out.stdout))


# ---------------------------------------------------------------- conversion


def weight_format(manifest: art.Manifest) -> str:
    """optimum-intel's weight format with the artifact's weight bit width."""
    return genai_precision(manifest)  # fp32 | int8 | int4: the same names


def int4_group_size(hf_dir: Path) -> int:
    """The largest of 128/64/32 dividing every matmul input width (SmolLM2's 576 needs 64)."""
    try:
        cfg = json.loads((hf_dir / "config.json").read_text())
    except (OSError, ValueError):
        return 128
    widths = [int(cfg.get(k) or 0) for k in ("hidden_size", "intermediate_size")]
    for group in (128, 64, 32):
        if all(w % group == 0 for w in widths if w):
            return group
    return -1  # per-channel


def export_command(optimum_cli: Path, hf_dir: Path, out: Path, fmt: str) -> list[str]:
    cmd = [
        str(optimum_cli),
        "export",
        "openvino",
        "--model",
        str(hf_dir),
        "--task",
        "text-generation-with-past",
        "--weight-format",
        fmt,
    ]
    if fmt == "int4":
        cmd += ["--group-size", str(int4_group_size(hf_dir))]
    return [*cmd, str(out)]


def convert(
    python: Path,
    hf_dir: Path,
    fmt: str,
    versions: dict[str, str],
    source_hash: str | None = None,
    progress: bool | None = None,
) -> Entry:
    """The OpenVINO IR of `hf_dir` at `fmt`, exported once per checkpoint content (`source_hash`,
    else the directory's files), exporter versions and format; held until `release()`."""
    if not (hf_dir / "config.json").exists():
        raise SpecportError(f"{hf_dir} has no config.json: optimum-intel cannot export it.")
    files = [] if source_hash else [p for p in hf_dir.glob("*") if p.is_file()]
    version = " ".join(f"{k} {v}" for k, v in sorted(versions.items()))
    entry = Entry(NAME, f"{content_key(files, source_hash or '', version)}-{fmt}")
    if (entry.path / "openvino_model.xml").exists():
        entry.used()
        return entry
    entry.clear()  # an incomplete entry left by an older specport
    show = sys.stderr.isatty() if progress is None else progress
    _say(show, f"[peer] exporting {hf_dir} to OpenVINO ({fmt}) with optimum-intel ...")
    tmp = entry.temp()
    cmd = export_command(python.parent / "optimum-cli", hf_dir, tmp, fmt)
    t0 = time.perf_counter()
    with tempfile.NamedTemporaryFile("w+", suffix=".log") as log:
        rc = subprocess.run(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=_worker_env(), check=False
        ).returncode
        if rc != 0 or not (tmp / "openvino_model.xml").exists():
            entry.discard(tmp)
            raise SpecportError(
                f"optimum-cli could not export {hf_dir} to OpenVINO {fmt} "
                f"({_last_line(Path(log.name))}); command: {' '.join(cmd)}"
            )
    entry.commit(tmp)
    entry.used()
    _say(show, f"[peer] exported in {time.perf_counter() - t0:.0f}s -> {entry.path}")
    evict(keep=entry.path)
    return entry


# ---------------------------------------------------------------- the worker


class Worker:
    """The venv's Python running openvino_worker.py; one JSON request and answer per line."""

    def __init__(self, python: Path) -> None:
        self.log = tempfile.NamedTemporaryFile("w+", prefix="specport-openvino-", suffix=".log")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [str(python), str(WORKER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            bufsize=1,
            env=_worker_env(),
        )

    def call(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except (BrokenPipeError, OSError):
            line = ""
        return parse_answer(line, request.get("op", "?"), Path(self.log.name))

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(BrokenPipeError, OSError):
                assert self.proc.stdin is not None
                self.proc.stdin.write('{"op": "quit"}\n')
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def parse_answer(line: str, op: str, log: Path | None = None) -> dict[str, Any]:
    """The worker's answer, or a SpecportError naming what went wrong in one line."""
    if not line.strip():
        tail = _last_line(log) if log is not None else "no output"
        raise SpecportError(f"the OpenVINO GenAI worker exited during {op!r} ({tail}).")
    try:
        answer = json.loads(line)
    except ValueError:
        raise SpecportError(
            f"the OpenVINO GenAI worker answered {op!r} with something that is not JSON: "
            f"{line.strip()[:200]!r}."
        ) from None
    if not isinstance(answer, dict):
        raise SpecportError(f"the OpenVINO GenAI worker answered {op!r} with {answer!r}.")
    if "error" in answer:
        raise SpecportError(f"OpenVINO GenAI failed ({op}): {answer['error']}")
    return answer


def _worker_env() -> dict[str, str]:
    """The environment without specport's Python settings (the venv has its own packages)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


# ---------------------------------------------------------------- the peer


class OpenVinoPeer:
    """OpenVINO GenAI's LLMPipeline on the artifact's checkpoint: plain greedy, prompt lookup or
    a draft model, at exact fp32 or at OpenVINO's defaults, with the same thread count."""

    def __init__(
        self,
        manifest: art.Manifest,
        config: Any,
        name: str = NAME,
        num_draft: int = 4,
        progress: bool | None = None,
    ) -> None:
        spec = parse_name(name)
        self.name = name
        self.precision, self.mode = spec.precision, spec.mode
        self.num_draft = num_draft
        self.threads = int(config.threads or (os.cpu_count() or 1))
        draft_artifact = getattr(config, "draft", None)
        if self.mode == "draft" and not draft_artifact:
            raise InputError(
                f"--peer {name} needs --draft ARTIFACT: a smaller model with the same tokenizer "
                "(its source model is exported for OpenVINO GenAI too)."
            )
        python = ensure_venv(progress)
        self.versions = venv_versions(python)
        self.format = weight_format(manifest)
        self.entry = convert(
            python, source_dir(manifest), self.format, self.versions, _gguf_hash(manifest), progress
        )
        self.draft_entry: Entry | None = None
        self.draft_artifact: str | None = None
        if self.mode == "draft":
            draft_manifest = art.read_manifest(Path(str(draft_artifact)), check_hashes=False)
            self.draft_artifact = str(draft_artifact)
            self.draft_entry = convert(
                python,
                source_dir(draft_manifest),
                weight_format(draft_manifest),
                self.versions,
                _gguf_hash(draft_manifest),
                progress,
            )
        self.properties = load_properties(self.precision, self.threads)
        self.worker = Worker(python)
        try:
            loaded = self.worker.call(
                {
                    "op": "load",
                    "model": str(self.entry.path),
                    "mode": self.mode,
                    "draft": str(self.draft_entry.path) if self.draft_entry else None,
                    "properties": self.properties,
                }
            )
        except BaseException:
            self.close()
            raise
        self.versions.update(loaded.get("versions") or {})

    def info(self) -> dict[str, Any]:
        info: dict[str, Any] = {
            "model_dir": str(self.entry.path),
            "weight_format": self.format,
            "precision": self.precision,
            "properties": self.properties,
            "threads": self.threads,
            "venv": str(venv_dir()),
            "versions": self.versions,
        }
        if self.mode == "lookup":
            info["speculation"] = {
                "kind": "prompt lookup",
                "max_ngram_size": LOOKUP_NGRAM,
                "num_assistant_tokens": self.num_draft,
            }
        elif self.mode == "draft":
            info["speculation"] = {
                "kind": "draft model",
                "draft_artifact": self.draft_artifact,
                "draft_model_dir": str(self.draft_entry.path) if self.draft_entry else None,
                "draft_is_target": bool(
                    self.draft_entry and self.draft_entry.path == self.entry.path
                ),
                "num_assistant_tokens": self.num_draft,
            }
        return info

    def generate(
        self, ids: Sequence[int], new_tokens: int
    ) -> tuple[list[int], float, int, float | None]:
        """(exactly `new_tokens` greedy tokens, seconds from the first token to the last,
        model runs that made tokens: the prefill's and one per decoding step, the worker's CPU
        seconds over the same span)."""
        answer = self.worker.call(
            {
                "op": "run",
                "ids": [int(t) for t in ids],
                "new_tokens": int(new_tokens),
                "mode": self.mode,
                "num_draft": self.num_draft,
                "ngram": LOOKUP_NGRAM,
            }
        )
        return run_result(answer)

    def run(self, prompts: Sequence[Sequence[int]], new_tokens: int) -> dict[str, Any]:
        """One timed generation in `specport bench` (plain decode rows)."""
        if len(prompts) != 1:
            raise InputError(f"--peer {self.name} runs batch 1 only.")
        answer = self.worker.call(
            {
                "op": "run",
                "ids": [int(t) for t in prompts[0]],
                "new_tokens": int(new_tokens),
                "mode": self.mode,
                "num_draft": self.num_draft,
                "ngram": LOOKUP_NGRAM,
            }
        )
        tokens, *_ = run_result(answer)
        return peer_metrics(
            1,
            len(prompts[0]),
            len(tokens) - 1,
            float(answer["t_start"]),
            float(answer["t_first"]),
            float(answer["t_end"]),
        )

    def close(self) -> None:
        worker = getattr(self, "worker", None)
        if worker is not None:
            worker.close()
            self.worker = None  # type: ignore[assignment]
        for entry in (getattr(self, "entry", None), getattr(self, "draft_entry", None)):
            if entry is not None:
                entry.release()


def load_properties(precision: str, threads: int) -> dict[str, Any]:
    """CPU plugin properties of a precision row, with the thread count."""
    return {"INFERENCE_NUM_THREADS": int(threads), **PRECISIONS[precision]}


def run_result(answer: dict[str, Any]) -> tuple[list[int], float, int, float | None]:
    """(tokens, decode seconds after the first token, model runs that made tokens, the worker
    process's CPU seconds over the same span, or None from a worker that does not say).

    The streamer is called once per model run that makes tokens (a speculative step hands over
    every token it accepted at once), so its calls count the runs, the prefill's included."""
    try:
        tokens = [int(t) for t in answer["tokens"]]
        decode = float(answer["t_end"]) - float(answer["t_first"])
        writes = int(answer["writes"])
        cpu = (
            float(answer["c_end"]) - float(answer["c_first"])
            if "c_end" in answer and "c_first" in answer
            else None
        )
    except (KeyError, TypeError, ValueError) as e:
        raise SpecportError(
            f"the OpenVINO GenAI worker's answer lacks {e}: {answer!r:.200}"
        ) from None
    return tokens, max(decode, 0.0), writes, None if cpu is None else max(cpu, 0.0)


def _gguf_hash(manifest: art.Manifest) -> str | None:
    """A GGUF source is converted to a fresh temp directory each time: key by the file's hash."""
    return (manifest.source.get("gguf") or {}).get("sha256")


def _say(show: bool, text: str) -> None:
    if show:
        print(text, file=sys.stderr, flush=True)
    logger.debug("%s", text)


def _last_line(log: Path | None) -> str:
    """The last non-empty line of a log (pip's and optimum's errors end there)."""
    if log is None:
        return "no output"
    try:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines()]
    except OSError:
        return "no output"
    lines = [line for line in lines if line]
    return _one_line(lines[-1]) if lines else "no output"


def _one_line(text: str) -> str:
    return " ".join(text.split())[:300]
