"""Execution-provider choice: what the user asked for, what is installed, what has a device.

`auto` prefers CANN (Ascend), then CUDA, then CPU. Asking for a provider that is not installed
fails with the list of what is, rather than onnxruntime's silent fallback to CPU.
"""

from __future__ import annotations

import logging
from typing import Any

from specport.errors import ProviderError

logger = logging.getLogger(__name__)

PROVIDERS: dict[str, str] = {
    "cann": "CANNExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "cpu": "CPUExecutionProvider",
}
AUTO_ORDER = ("cann", "cuda", "cpu")


def available() -> list[str]:
    """Short names of the providers this onnxruntime build offers."""
    import onnxruntime as ort

    installed = set(ort.get_available_providers())
    return [short for short, full in PROVIDERS.items() if full in installed]


def resolve(name: str) -> list[str]:
    """onnxruntime provider list for a short name (`auto`, `cpu`, `cuda`, `cann`)."""
    key = (name or "auto").lower()
    have = available()
    if key == "auto":
        for short in AUTO_ORDER:
            if short in have:
                return _with_cpu_fallback(short)
        raise ProviderError(
            "onnxruntime offers no usable execution provider; reinstall onnxruntime."
        )
    if key not in PROVIDERS:
        raise ProviderError(
            f"unknown provider {name!r}. Choose one of: auto, {', '.join(PROVIDERS)} "
            f"(installed here: {', '.join(have)})."
        )
    if key not in have:
        hint = {
            "cuda": "install onnxruntime-gpu (and a CUDA driver) to use it",
            "cann": "install onnxruntime built with the CANN provider on an Ascend machine to use it",
        }.get(key, "")
        raise ProviderError(
            f"provider {key!r} is not available in this onnxruntime (installed: {', '.join(have)}); {hint}."
        )
    return _with_cpu_fallback(key)


def _with_cpu_fallback(short: str) -> list[str]:
    full = PROVIDERS[short]
    return [full] if short == "cpu" else [full, PROVIDERS["cpu"]]


def check_session(session: Any, requested: str) -> str:
    """After session creation: the provider really in use; error if a device provider fell back."""
    used = session.get_providers()
    primary = used[0] if used else "CPUExecutionProvider"
    short = next((k for k, v in PROVIDERS.items() if v == primary), primary)
    if requested not in ("auto", "cpu") and short != requested:
        raise ProviderError(
            f"onnxruntime could not start the {requested} provider (no device or driver?); it fell back to {short}. "
            "Check the device with nvidia-smi / npu-smi, or use --provider cpu."
        )
    return short
