"""Compile the static graphs into QNN EPContext models for one Snapdragon SoC.

An EPContext model is a small ONNX file whose one node (`com.microsoft.EPContext`) points at a
QNN context binary: the graph as HtpPrepare compiled it for the SoC, weights included. Loading
it skips the compile (minutes for a large model on a device), so this is what ships to a phone
or laptop. onnxruntime-qnn's x86-64 wheel compiles for any SoC it knows (its HTP backend is an
emulator there), which is how an artifact for a device is built on a workstation or in CI.

Each graph gets its own context binary, so the two binaries each hold the weights (fp16 for a
float graph). QNN can share one binary between them (`ep.share_ep_contexts` with
`enable_htp_weight_sharing`): onnxruntime-qnn 2.7.0 compiles that on x86-64, but reloading the
shared binary crashes the emulator (segfault, measured), and what cannot be reloaded here cannot
be tested here. The ONNX graphs themselves do share one weights file (static_graphs.py).

The compile refuses a graph with any node the NPU cannot run: `session.disable_cpu_ep_fallback`
is set, so what compiles here runs entirely on the NPU.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from specport.core import ep_plugins
from specport.core.errors import ExportError, ProviderError

logger = logging.getLogger(__name__)

# SoC model numbers onnxruntime's QNN provider takes as `soc_model` (QNN SDK's list); the ones
# users ask for most. Any positive number is passed through.
KNOWN_SOCS = {
    60: "Snapdragon X Elite (Hexagon v73)",
    69: "Snapdragon 8 Gen 3 (Hexagon v75)",
    57: "Snapdragon 8 Gen 2 (Hexagon v73)",
    43: "Snapdragon 8 Gen 1 (Hexagon v69)",
}


def check_qnn(soc: int | None) -> None:
    """Before any slow step: a SoC needs onnxruntime-qnn to compile for it."""
    if soc is None:
        return
    if soc <= 0:
        raise ExportError(f"--soc {soc}: give the SoC model number (e.g. 60 = X Elite).")
    try:
        ep_plugins.devices("qnn")
    except ProviderError as e:
        raise ExportError(f"--soc compiles a QNN context binary: {e}") from None


def compile_contexts(directory: Path, graphs: dict[str, str], soc: int) -> dict[str, Any]:
    """Compile each graph (role -> file) into `<stem>.qnn.onnx` + its binary; return a report."""
    import onnxruntime as ort

    devices = ep_plugins.devices("qnn")
    options = {"backend_type": "htp", "soc_model": str(soc)}
    report: dict[str, Any] = {"soc": soc, "soc_name": KNOWN_SOCS.get(soc, "unknown"), "files": {}}
    before = {p.name for p in directory.iterdir()}
    for role, name in graphs.items():
        target = directory / (Path(name).stem + ".qnn.onnx")
        so = ort.SessionOptions()
        so.log_severity_level = 3
        so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
        so.add_session_config_entry("ep.context_enable", "1")
        so.add_session_config_entry("ep.context_file_path", str(target))
        so.add_session_config_entry("ep.context_embed_mode", "0")
        so.add_provider_for_devices(devices, options)
        start = time.perf_counter()
        try:
            ort.InferenceSession(str(directory / name), sess_options=so)
        except Exception as e:
            text = " ".join(str(e).split())[:300]
            raise ExportError(
                f"QNN could not compile {name} for SoC {soc} with every node on the NPU: {text}"
            ) from None
        if not target.exists():
            raise ExportError(f"QNN wrote no context model for {name} (expected {target.name}).")
        report["files"][role] = target.name
        report[f"{role}_seconds"] = round(time.perf_counter() - start, 2)
        logger.info("compiled %s for SoC %s in %.1f s", name, soc, report[f"{role}_seconds"])
    new = sorted({p.name for p in directory.iterdir()} - before)
    report["bytes"] = {n: (directory / n).stat().st_size for n in new}
    return report
