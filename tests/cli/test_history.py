"""The manifest's `history` is complete and truthful for chains of commands.

What users rely on: every command that writes an artifact appends itself (command, options,
input, time, version) and `inspect` and the model card show the steps in order; a second
weight quantization of a quantized artifact is refused with the command to run on the float
artifact instead, while adding only what the first step did not cover (an int8 KV cache) is
allowed and recorded as a second step; an artifact written before history loads as before.
"""

from __future__ import annotations

import json

import pytest

from specport.artifact.manifest import read_manifest
from specport.core.history import entries

pytestmark = pytest.mark.slow  # the module fixture exports and quantizes a tiny model (~40 s)


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """float (exported by the library call, so without history) -> w4a16 rtn, through the CLI."""
    from specport.cli import main
    from tests.export_cache import cached_export
    from tests.fixtures import TINY, make_llama

    root = tmp_path_factory.mktemp("history")
    hf = make_llama(root / "hf", context_length=128, **TINY)  # type: ignore[arg-type]
    float_art = root / "float"
    cached_export(hf, float_art, skip_verify=True, progress=False)
    rtn = root / "rtn"
    args = ["quantize", str(float_art), "--out", str(rtn), "--scheme", "w4a16", "--algo", "rtn"]
    assert main(args) == 0
    return float_art, rtn


def test_quantize_appends_itself(chain):
    float_art, rtn = chain
    assert entries(read_manifest(float_art)) == []  # written before history: loads, empty
    (step,) = entries(read_manifest(rtn))
    assert step["command"] == "quantize"
    assert step["options"]["scheme"] == "w4a16" and step["options"]["algo"] == "rtn"
    assert step["input"]["path"] == str(float_art) and step["input"]["of"] == "specport.json"
    assert len(step["input"]["sha256"]) == 64 and step["time"].endswith("Z")


def test_a_second_weight_quantization_is_refused_with_the_fix(chain, cli, files, tmp_path):
    float_art, rtn = chain
    before = files(rtn.parent)
    out = tmp_path / "hqq"
    code, _, err = cli("quantize", rtn, "--out", out, "--scheme", "w4a16", "--algo", "hqq")
    assert code == 2
    line = next(x for x in err.splitlines() if x.startswith("error"))
    assert "already holds w4a16 rtn weights" in line
    assert f"specport quantize {float_art} --out {out} --scheme w4a16 --algo hqq" in line
    assert not out.exists() and files(rtn.parent) == before


def test_kv_cache_after_weights_is_recorded_as_a_second_step(chain, cli, tmp_path):
    from tests.passes.quant._tiny import write_corpus

    _, rtn = chain
    calib = write_corpus(tmp_path / "calib.txt", docs=8)
    out = tmp_path / "rtn-kv8"
    code, _, err = cli(
        "quantize", rtn, "--out", out, "--scheme", "none", "--kv-cache", "int8", "--calib", calib
    )
    assert code == 0, err
    manifest = read_manifest(out)
    steps = entries(manifest)
    assert [s["command"] for s in steps] == ["quantize", "quantize"]
    assert steps[0]["options"]["algo"] == "rtn" and steps[1]["options"]["kv_cache"] == "int8"
    assert steps[1]["input"]["path"] == str(rtn)
    # the weights are still the first step's, the cache the second's
    assert manifest.quant["scheme"] == "w4a16" and manifest.quant["algorithm"] == "rtn"
    assert manifest.kv.dtype == "int8"
    code, text, _ = cli("inspect", out)
    assert code == 0 and "history" in text
    assert text.index("quantize --scheme w4a16 --algo rtn") < text.index("--kv-cache int8")
    code, js, _ = cli("inspect", out, "--json")
    assert [s["command"] for s in json.loads(js)["history"]] == ["quantize", "quantize"]
    card = (out / "README.md").read_text()
    made = card[card.index("## How it was made") :]
    assert "1. `specport quantize --scheme w4a16 --algo rtn`" in made
    assert "2. `specport quantize --scheme none" in made and "--kv-cache int8" in made
    assert str(tmp_path) not in made  # a published card names no machine folders


def test_the_card_of_an_artifact_without_history_says_so(chain):
    float_art, _ = chain
    from specport.artifact.model_card import _history_section

    assert "Not recorded" in " ".join(_history_section(read_manifest(float_art)))


def test_optimize_records_its_step_in_the_onnx_file(cli, tmp_path):
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])
    src = tmp_path / "relu.onnx"
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(src))
    out1, out2 = tmp_path / "o1.onnx", tmp_path / "o2.onnx"
    assert cli("optimize", src, "--out", out1)[0] == 0
    assert cli("optimize", out1, "--out", out2, "--target", "neutral")[0] == 0
    code, js, _ = cli("inspect", out2, "--json")
    steps = json.loads(js)["history"]
    assert [s["command"] for s in steps] == ["optimize", "optimize"]
    assert [s["input"]["path"] for s in steps] == [str(src), str(out1)]
    assert steps[1]["options"]["target"] == "neutral"


def test_history_describe_reads_as_a_command():
    from specport.core.history import command_line

    entry = {
        "command": "quantize",
        "options": {"scheme": "w4a16", "algo": "rtn", "fuse": False, "calib_files": ["/a/b.txt"]},
    }
    assert command_line(entry) == "quantize --scheme w4a16 --algo rtn --no-fuse --calib /a/b.txt"
    assert command_line(entry, names_only=True).endswith("--calib b.txt")
