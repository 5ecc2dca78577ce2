"""onnxruntime plugin execution providers: register a pip-installed EP library, find its devices.

onnxruntime >= 1.23 loads some providers as separate libraries shipped by their own wheels
(`onnxruntime-qnn` for Qualcomm's QNN, `onnxruntime-ep-openvino` for Intel's OpenVINO): they
never appear in `get_available_providers()`; a session reaches them through
`SessionOptions.add_provider_for_devices`. Kept in the core (not the runtime) because the
exporter compiles QNN context binaries with the same registration.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from typing import Any

from specport.core.errors import ProviderError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Plugin:
    ep_name: str  # onnxruntime's provider name
    module: str  # the Python package that ships the library (get_library_path())
    package: str  # what to pip install
    note: str = ""  # why a registered plugin may still list no device


PLUGINS: dict[str, Plugin] = {
    "qnn": Plugin("QNNExecutionProvider", "onnxruntime_qnn", "onnxruntime-qnn"),
    "openvino": Plugin(
        "OpenVINOExecutionProvider",
        "onnxruntime_ep_openvino",
        "onnxruntime-ep-openvino",
        "the OpenVINO plugin offers Intel CPUs, GPUs and NPUs only",
    ),
}

_registered: set[str] = set()


def installed(short: str) -> bool:
    """Whether the plugin's Python package is importable (no registration, no device check)."""
    try:
        importlib.import_module(PLUGINS[short].module)
    except ImportError:
        return False
    return True


def registered(short: str) -> bool:
    """Whether this process registered the plugin's library (it then shows in onnxruntime's
    `get_available_providers()` like a built-in provider)."""
    return PLUGINS[short].ep_name in _registered


def devices(short: str) -> list[Any]:
    """The onnxruntime EP devices of plugin `short`, registering its library once.

    Raises ProviderError (one line, what to install or why nothing was found)."""
    import onnxruntime as ort

    plugin = PLUGINS[short]
    try:
        module = importlib.import_module(plugin.module)
    except ImportError as e:
        raise ProviderError(
            f"provider {short!r} needs the {plugin.package} package: pip install "
            f"{plugin.package} (or specport[{short}]) ({e})"
        ) from None
    if plugin.ep_name not in _registered:
        try:
            ort.register_execution_provider_library(plugin.ep_name, module.get_library_path())
        except Exception as e:  # onnxruntime raises its own Fail type
            if "already registered" not in str(e):
                raise ProviderError(
                    f"onnxruntime could not load the {plugin.ep_name} library from "
                    f"{plugin.package}: {str(e).splitlines()[0]}"
                ) from None
        _registered.add(plugin.ep_name)
    found = [d for d in ort.get_ep_devices() if d.ep_name == plugin.ep_name]
    if not found:
        why = f" ({plugin.note})" if plugin.note else ""
        raise ProviderError(f"{plugin.ep_name} is installed but found no device here{why}.")
    return found


def available(short: str) -> bool:
    """True when the plugin is installed and lists at least one device."""
    if not installed(short):
        return False
    try:
        devices(short)
    except ProviderError:
        return False
    return True
