"""Plugin execution providers (qnn, openvino): clear one-line errors, no silent CPU fallback."""

from __future__ import annotations

import importlib

import pytest

from specport.core import ep_plugins
from specport.core.errors import ProviderError
from specport.runtime import providers
from specport.runtime.session import SessionConfig, session_options


@pytest.fixture
def no_plugins(monkeypatch):
    """As if neither plugin package were installed."""
    real = importlib.import_module

    def fake(name, *args, **kwargs):
        if name in {p.module for p in ep_plugins.PLUGINS.values()}:
            raise ImportError(f"No module named {name!r}")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(ep_plugins.importlib, "import_module", fake)


@pytest.mark.parametrize(
    ("short", "package"), [("qnn", "onnxruntime-qnn"), ("openvino", "onnxruntime-ep-openvino")]
)
def test_missing_plugin_is_one_line_naming_the_package(no_plugins, short, package):
    with pytest.raises(ProviderError) as e:
        providers.resolve(short)
    message = str(e.value)
    assert "\n" not in message
    assert f"pip install {package}" in message and f"specport[{short}]" in message


def test_plugin_without_a_device_says_so(monkeypatch):
    if not ep_plugins.installed("openvino"):
        pytest.skip("onnxruntime-ep-openvino is not installed")
    import onnxruntime as ort

    monkeypatch.setattr(ort, "get_ep_devices", lambda: [])
    with pytest.raises(ProviderError, match="found no device here .*Intel"):
        providers.resolve("openvino")


def test_auto_never_picks_a_plugin():
    assert providers.resolve("auto")[0] in (
        "CANNExecutionProvider",
        "CUDAExecutionProvider",
        "CPUExecutionProvider",
    )


def test_qnn_sessions_never_fall_back_to_cpu():
    so = session_options(SessionConfig(provider="qnn"))
    assert so.get_session_config_entry("session.disable_cpu_ep_fallback") == "1"
    assert providers.resolve.__doc__ and providers._with_cpu_fallback("qnn") == [
        "QNNExecutionProvider"
    ]


def test_cli_offers_the_plugin_providers():
    import argparse

    from specport.commands._args import add_runtime_options

    parser = argparse.ArgumentParser()
    add_runtime_options(parser)
    assert parser.parse_args(["--provider", "QNN"]).provider == "qnn"
    assert parser.parse_args(["--provider", "openvino"]).provider == "openvino"


@pytest.mark.skipif(not ep_plugins.available("qnn"), reason="onnxruntime-qnn is not installed")
def test_a_graph_the_npu_cannot_run_fails_in_one_line(tmp_path):
    """A dynamic-shape graph (what --target cpu ships) on qnn: refused, not run on the CPU."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper

    from specport.runtime.session import make_session

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n"])
    node = helper.make_node("Einsum", ["x", "x"], ["y"], equation="i,i->i")
    model = helper.make_model(helper.make_graph([node], "g", [x], [y]))
    model.opset_import[0].version = 23
    model.ir_version = 10
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    config = SessionConfig(provider="qnn", provider_options={"soc_model": "60"})
    with pytest.raises(ProviderError) as e:
        make_session(path, config)
    assert "\n" not in str(e.value) and "--target qnn" in str(e.value)
    assert np.float32  # numpy present (the graph would run on CPU if fallback were allowed)
