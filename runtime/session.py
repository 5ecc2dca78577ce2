"""Create the onnxruntime session for an artifact, with options chosen on purpose."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specport.runtime import providers as prov

logger = logging.getLogger(__name__)


@dataclass
class SessionConfig:
    """Knobs that matter for LLM decode on onnxruntime.

    intra_op_threads: 0 = one per physical core (onnxruntime's default heuristic).
    graph_optimization: "all" | "extended" | "basic" | "disable".
    """

    provider: str = "auto"
    intra_op_threads: int = 0
    graph_optimization: str = "all"
    enable_mem_pattern: bool = True
    disable_prepacking: bool = False
    log_severity: int = 3


_LEVELS = {
    "disable": "ORT_DISABLE_ALL",
    "basic": "ORT_ENABLE_BASIC",
    "extended": "ORT_ENABLE_EXTENDED",
    "all": "ORT_ENABLE_ALL",
}


def make_session(
    model_path: str | os.PathLike[str], config: SessionConfig | None = None
) -> tuple[Any, str]:
    """Return (InferenceSession, short provider name actually in use)."""
    import onnxruntime as ort

    config = config or SessionConfig()
    providers = prov.resolve(config.provider)
    so = ort.SessionOptions()
    so.graph_optimization_level = getattr(
        ort.GraphOptimizationLevel, _LEVELS[config.graph_optimization]
    )
    if config.intra_op_threads:
        so.intra_op_num_threads = config.intra_op_threads
    so.enable_mem_pattern = config.enable_mem_pattern
    so.log_severity_level = config.log_severity
    if config.disable_prepacking:
        so.add_session_config_entry("session.disable_prepacking", "1")
    session = ort.InferenceSession(str(Path(model_path)), sess_options=so, providers=providers)
    used = prov.check_session(session, config.provider.lower())
    logger.info("session on %s (%s)", used, providers)
    return session, used
