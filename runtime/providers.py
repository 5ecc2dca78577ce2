"""Execution-provider choice: what the user asked for, what is installed, what has a device.

`auto` prefers CANN (Ascend), then CUDA, then CPU. Asking for a provider that is not installed
fails with the list of what is, rather than onnxruntime's silent fallback to CPU.

`qnn` (Qualcomm NPUs, `onnxruntime-qnn`) and `openvino` (`onnxruntime-ep-openvino`, or the
`onnxruntime-openvino` build) are plugin providers (core/ep_plugins.py): a session reaches
them through `add_provider_for_devices` (`plugin_devices`). `qnn` never falls back to the CPU:
its sessions set `session.disable_cpu_ep_fallback`, so a graph the NPU cannot run in full fails
to open instead of running slowly somewhere else. `auto` never picks a plugin.
"""

from __future__ import annotations

import logging
from typing import Any

from specport.core import ep_plugins
from specport.core.errors import ProviderError

logger = logging.getLogger(__name__)

PROVIDERS: dict[str, str] = {
    "cann": "CANNExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "cpu": "CPUExecutionProvider",
    "qnn": "QNNExecutionProvider",
    "openvino": "OpenVINOExecutionProvider",
}
AUTO_ORDER = ("cann", "cuda", "cpu")
# session config entries a provider always gets
PROVIDER_ENTRIES: dict[str, dict[str, str]] = {
    "qnn": {"session.disable_cpu_ep_fallback": "1"},
}


def available() -> list[str]:
    """Short names of the providers this onnxruntime build offers (plugins: installed)."""
    import onnxruntime as ort

    installed = set(ort.get_available_providers())
    return [
        short
        for short, full in PROVIDERS.items()
        if full in installed or (short in ep_plugins.PLUGINS and ep_plugins.installed(short))
    ]


def plugin_devices(short: str) -> list[Any] | None:
    """The EP devices to add to the session options for `short`, or None when `short` is a
    provider onnxruntime itself lists (then it goes in the `providers` list)."""
    if short not in ep_plugins.PLUGINS or not ep_plugins.installed(short):
        return None  # e.g. the onnxruntime-openvino build, which lists the provider itself
    return ep_plugins.devices(short)


def resolve(name: str) -> list[str]:
    """onnxruntime provider list for a short name (`auto` or a key of PROVIDERS)."""
    import onnxruntime as ort

    key = (name or "auto").lower()
    if key in ep_plugins.PLUGINS:
        built_in = PROVIDERS[key] in ort.get_available_providers()
        if not built_in or ep_plugins.registered(key) or ep_plugins.installed(key):
            ep_plugins.devices(key)  # raises the one-line reason (not installed / no device)
        return _with_cpu_fallback(key)
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
    if short == "cpu" or short == "qnn":  # qnn: no fallback (PROVIDER_ENTRIES)
        return [full]
    return [full, PROVIDERS["cpu"]]


def plugin_failure(short: str, error: Exception) -> ProviderError:
    """One line for a plugin provider's refusal to open a graph (onnxruntime's is pages long)."""
    text = " ".join(str(error).split())
    hint = (
        " With qnn, every node must run on the NPU (no CPU fallback): export with --target qnn."
        if short == "qnn"
        else ""
    )
    return ProviderError(f"the {short} provider could not open the graph: {text[:300]}.{hint}")


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
