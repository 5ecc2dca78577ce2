"""Create the onnxruntime session for an artifact, with options chosen on purpose.

Choices and why (measured on the 2-core benchmark machine, see `specport bench`):
- intra_op_threads: 0 = one per core, which is what decode (GEMV-bound) wants.
- allow_spinning: onnxruntime's pool threads busy-wait between ops by default. On a dedicated
  machine that saves a wake-up per op; on an oversubscribed one (more runnable work than cores)
  the spinning thread burns the time slice the other thread needs, and decode was ~2x slower.
  `None` (auto) spins only when other processes' runnable threads, sampled over ~35 ms at
  session creation, leave a core free (runtime/idle_core.py; this process's own recent work,
  e.g. an export or quantization just before, does not count: the 1-minute load average that
  decided before counted it, and such sessions did not spin on an idle machine).
- force_spinning_stop (with spinning): a pool spins between the ops of a run and stops when
  the run ends. Speculation with a draft model runs two sessions in turn, each with its own
  pool; left spinning, the idle session's threads took the cores the running one needed, and
  `--speculative draft` ran at 0.54-0.61x plain decoding (SmolLM2, 4-bit draft, 2 cores; with
  the stop, 0.87-1.04x). Plain decoding, one run per token, measured the same within noise
  (W4A8: 93.5 tok/s without the stop, 93.7 with, five alternating rounds each).
- prepacking: MatMul weights repacked once at load for the GEMM kernel (onnxruntime frees the
  original after packing). On the 32M benchmark model RSS was 183 MB with it and 178 MB without,
  decode speed equal within noise: kept on (it is what prefill wants).
- graph_optimization "all": the CPU fusions (SkipSimplifiedLayerNorm, QuickGelu from
  x*sigmoid(x), Split from paired Slices) matter for the fused graph.
- huge_pages: the buffers onnxruntime allocated for the weights are collapsed into 2 MB
  transparent huge pages after the session is built (runtime/hugepages.py; Linux): decode
  streams every weight per token, and on 4 KB pages SmolLM2 W4A8 ran 8-20% slower.
  `SPECPORT_HUGE_PAGES=0` in the environment turns it off (it adds ~2.5 s per GB at load).
External weights (`model.onnx.data`) are read by onnxruntime itself (it memory-maps the file
where offsets allow); there is no session option for it, so none is exposed.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specport.artifact.manifest import Manifest
from specport.core.errors import ArtifactError
from specport.runtime import providers as prov
from specport.runtime.hugepages import HugePages
from specport.runtime.idle_core import machine_has_idle_core

logger = logging.getLogger(__name__)


@dataclass
class SessionConfig:
    """Knobs that matter for LLM decode on onnxruntime.

    intra_op_threads: 0 = one per core.
    graph_optimization: "all" | "extended" | "basic" | "disable".
    allow_spinning: True / False, or None = auto (spin only if the machine has an idle core,
    decided once per config at its first session, so `describe()` reports what was applied).
    """

    provider: str = "auto"
    intra_op_threads: int = 0
    graph_optimization: str = "all"
    enable_mem_pattern: bool = True
    disable_prepacking: bool = False
    allow_spinning: bool | None = None
    # SPECPORT_HUGE_PAGES=0 turns it off: collapsing costs ~2.5 s per GB of weights at load
    huge_pages: bool = field(default_factory=lambda: os.environ.get("SPECPORT_HUGE_PAGES") != "0")
    log_severity: int = 3
    # Extra onnxruntime session config entries an artifact needs to mean what it says, e.g.
    # a QDQ int4 graph that must not be run with int8 activations (manifest quant section).
    config_entries: dict[str, str] = field(default_factory=dict)
    # Options of a plugin provider (qnn: backend_type, soc_model; see runtime/providers.py).
    provider_options: dict[str, str] = field(default_factory=dict)
    _auto_spin: bool | None = field(default=None, init=False, repr=False, compare=False)

    def resolved_spinning(self) -> bool:
        """The explicit choice, or the auto one, made once: sampling again could answer
        otherwise than what the session was given (and costs ~35 ms)."""
        if self.allow_spinning is not None:
            return self.allow_spinning
        if self._auto_spin is None:
            self._auto_spin = machine_has_idle_core()
        return self._auto_spin

    def describe(self) -> dict[str, Any]:
        return {
            "provider": self.provider,
            "intra_op_threads": self.intra_op_threads or (os.cpu_count() or 1),
            "graph_optimization": self.graph_optimization,
            "prepacking": not self.disable_prepacking,
            "allow_spinning": self.resolved_spinning(),
            "huge_pages": self.huge_pages,
        }


_LEVELS = {
    "disable": "ORT_DISABLE_ALL",
    "basic": "ORT_ENABLE_BASIC",
    "extended": "ORT_ENABLE_EXTENDED",
    "all": "ORT_ENABLE_ALL",
}


def spare_core(session: Any) -> bool:
    """True when the machine has more cores than the session's intra-op threads."""
    cores = os.cpu_count() or 1
    try:
        threads = int(session.get_session_options().intra_op_num_threads) or cores
    except AttributeError:
        threads = cores
    return cores > threads


def session_options(config: SessionConfig) -> Any:
    """onnxruntime.SessionOptions for `config` (also used to give peers the same settings)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = getattr(
        ort.GraphOptimizationLevel, _LEVELS[config.graph_optimization]
    )
    so.intra_op_num_threads = config.intra_op_threads or (os.cpu_count() or 1)
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.enable_mem_pattern = config.enable_mem_pattern
    so.log_severity_level = config.log_severity
    if config.disable_prepacking:
        so.add_session_config_entry("session.disable_prepacking", "1")
    spin = "1" if config.resolved_spinning() else "0"
    so.add_session_config_entry("session.intra_op.allow_spinning", spin)
    so.add_session_config_entry("session.inter_op.allow_spinning", spin)
    if config.resolved_spinning():
        # spin between the ops of a run, not after it: a draft model, an EAGLE or MTP head and
        # its target run in turn, each session with its own pool, and a pool left spinning
        # while the other session runs takes a core from it
        so.add_session_config_entry("session.force_spinning_stop", "1")
    entries = {**prov.PROVIDER_ENTRIES.get(config.provider.lower(), {}), **config.config_entries}
    for key, value in entries.items():
        so.add_session_config_entry(key, str(value))
    return so


def make_session(
    model_path: str | os.PathLike[str] | bytes, config: SessionConfig | None = None
) -> tuple[Any, str]:
    """Return (InferenceSession, short provider name actually in use).

    `model_path` may be a serialized graph (see `artifact_graph`); its external weights are
    then found through the config entry that names their folder."""
    import onnxruntime as ort

    config = config or SessionConfig()
    providers: list[str] | None = prov.resolve(config.provider)
    so = session_options(config)
    devices = prov.plugin_devices(config.provider.lower())
    if devices is not None:  # a plugin provider (qnn, openvino) is added by device
        so.add_provider_for_devices(devices, plugin_options(config))
        providers = None
    source = model_path if isinstance(model_path, bytes) else str(Path(model_path))
    pages = HugePages() if config.huge_pages else None
    try:
        session = ort.InferenceSession(source, sess_options=so, providers=providers)
    except Exception as e:
        if devices is None:
            raise
        raise prov.plugin_failure(config.provider.lower(), e) from None
    if pages is not None:
        pages.apply()
    used = prov.check_session(session, config.provider.lower())
    logger.info("session on %s (%s), options %s", used, providers, config.describe())
    return session, used


def plugin_options(config: SessionConfig) -> dict[str, str]:
    """The options a plugin provider gets: the config's, over our defaults. OpenVINO computes
    in bf16 on CPUs with AVX512-BF16 / AMX unless told otherwise, which changes greedy tokens;
    its CPU device's INFERENCE_PRECISION_HINT f32 (through `load_config`) keeps the graph's own
    float32, as every other provider does (its `precision` option FP32 / ACCURACY did not, on
    onnxruntime-ep-openvino 1.8.1 with AMX: the tokens stayed bf16's)."""
    defaults: dict[str, str] = {}
    if config.provider.lower() == "openvino":
        defaults["load_config"] = json.dumps({"CPU": {"INFERENCE_PRECISION_HINT": "f32"}})
    return {**defaults, **config.provider_options}


def artifact_graph(
    directory: Path, manifest: Manifest, mtp_branch: bool
) -> tuple[str | bytes, dict[str, str]]:
    """(graph to open, extra session config entries) for an artifact.

    The one place that decides whether a session carries an MTP artifact's branch. onnxruntime
    runs every node of a graph whatever outputs are fetched, so plain, n-gram and draft-model
    decoding on the MTP graph would pay for the heads at every step (SmolLM2-135M: 1.47x
    slower per token). Without `mtp_branch` the session opens the artifact's stored graph
    without the branch (`passes/mtp_graphs.py`, written when the artifact was made): the runtime
    opens graphs, it never rewrites them.
    """
    path = directory / manifest.model_file
    if mtp_branch or not (manifest.mtp or {}).get("heads"):
        return str(path), {}
    plain = mtp_graph_file(directory, manifest, "plain")
    logger.info(
        "MTP branch left out of the session (%s): onnxruntime runs every node, so decoding "
        "other than --speculative mtp would pay for the heads at every step",
        plain,
    )
    return str(directory / plain), {}


def mtp_graph_file(directory: Path, manifest: Manifest, kind: str) -> str:
    """The file of an MTP artifact's stored graph of ``kind`` (plain, tree_verify); an artifact
    made before these were stored gets the one command that adds them."""
    graphs = (manifest.mtp or {}).get("graphs") or {}
    if kind not in graphs:
        raise ArtifactError(
            f"{directory} is an MTP artifact from an older specport (no stored {kind} graph); "
            f"run `specport upgrade {directory}` once to add it."
        )
    return str(graphs[kind])


def artifact_session_entries(manifest: Manifest) -> dict[str, str]:
    """Session config entries the artifact's recipe requires (see the manifest's quant section)."""
    quant = manifest.quant or {}
    return {str(k): str(v) for k, v in (quant.get("ort_session_config") or {}).items()}
