"""One test per class of mistake a user makes at the command line.

Each asserts the exit code (2: the options cannot work; 1: the world is not as needed), that
the message names the fix, that there is no traceback, and that no file the user had changed
(hashes before and after). The export cases use a model directory with a config.json and no
weights: whatever they report was found before any weights were loaded.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest


def _one_line_error(err: str) -> str:
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err
    return lines[0]


# ---- 1. an output that would replace a user's file -------------------------------------
@pytest.mark.parametrize("command", ["export", "quantize", "train-mtp", "optimize", "demo"])
def test_out_is_an_existing_user_file(cli, files, tmp_path, command, request):
    user = tmp_path / ("notes.onnx" if command == "optimize" else "notes.txt")
    user.write_text("precious")
    (tmp_path / "data.txt").write_text("Once upon a time.\n\nThe end.\n")
    src = _source_for(command, request, tmp_path)
    args = {
        "export": ["export", src, "--out", user],
        "quantize": ["quantize", src, "--out", user, "--scheme", "w4a16"],
        "train-mtp": ["train-mtp", src, "--out", user, "--data", tmp_path / "data.txt"],
        "optimize": ["optimize", src, "--out", user],
        "demo": ["demo", "--out", user],
    }[command]
    before = files(tmp_path, Path(src))
    code, _, err = cli(*args)
    assert code == 1
    line = _one_line_error(err)
    assert "refusing to replace" in line or "is a file" in line
    assert "Choose" in line or "give a directory" in line
    assert files(tmp_path, Path(src)) == before


def _source_for(command: str, request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    if command == "export":
        return request.getfixturevalue("config_only_model")
    if command == "optimize":
        return _tiny_onnx(tmp_path)
    if command == "demo":
        return tmp_path
    return request.getfixturevalue("tiny_llama_artifact")


def _tiny_onnx(tmp_path: Path, name: str = "m.onnx") -> Path:
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    path = tmp_path / name
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


# ---- 2. an output that is, contains or lies inside an input ----------------------------
@pytest.mark.parametrize(
    "case", ["quantize-same", "quantize-inside", "quantize-parent", "train-mtp-same"]
)
def test_out_overlaps_the_input_artifact(cli, files, tiny_llama_artifact, case):
    a = tiny_llama_artifact
    out = {
        "quantize-same": a,
        "quantize-inside": a / "q",
        "quantize-parent": a.parent,
        "train-mtp-same": a,
    }[case]
    command = case.rsplit("-", 1)[0]
    extra = ["--scheme", "w4a16"] if command == "quantize" else ["--data", a / "specport.json"]
    before = files(a)
    code, _, err = cli(command, a, "--out", out, *extra)
    assert code == 2
    line = _one_line_error(err)
    assert "input" in line and "--out" in line
    assert files(a) == before


def test_export_out_inside_the_source_and_optimize_onto_itself(
    cli, files, config_only_model, tmp_path
):
    before = files(config_only_model)
    code, _, err = cli("export", config_only_model, "--out", config_only_model / "onnx")
    assert code == 2 and "outside" in _one_line_error(err)
    m = _tiny_onnx(tmp_path)
    code, _, err = cli("optimize", m, "--out", m)
    assert code == 2 and "Choose a new --out" in _one_line_error(err)
    # weights file of OUT would be the input: m.onnx.data <- --out m.onnx is the same case;
    # an OUT whose .data is another file the user has is refused as well
    (tmp_path / "new.onnx.data").write_text("user data")
    code, _, err = cli("optimize", m, "--out", tmp_path / "new.onnx")
    assert code == 1 and "refusing to replace" in _one_line_error(err)
    assert files(config_only_model) == before
    assert (tmp_path / "new.onnx.data").read_text() == "user data"


# ---- 3. an output directory that holds other files -------------------------------------
def test_out_is_a_folder_of_other_files(cli, files, config_only_model, tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "thesis.tex").write_text("precious")
    before = files(folder)
    code, _, err = cli("export", config_only_model, "--out", folder)
    assert code == 1
    assert "Choose an empty or new --out" in _one_line_error(err)
    assert files(folder) == before


# ---- 4. an output that cannot be written -----------------------------------------------
def test_out_cannot_be_written(cli, config_only_model, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    code, _, err = cli("export", config_only_model, "--out", blocker / "sub" / "art")
    assert code == 1
    line = _one_line_error(err)
    assert "is a file, not a directory" in line and "Choose another --out" in line
    assert blocker.read_text() == "x"


# ---- 5. a bad ONNX input: one line, exit 1, no output file -----------------------------
def _bad_onnx(kind: str, tmp_path: Path) -> Path:
    import onnx
    from onnx import TensorProto, helper

    good = _tiny_onnx(tmp_path, "good.onnx")
    p = tmp_path / f"{kind}.onnx"
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    if kind == "not-onnx":
        p.write_text("this is a text file\n")
    elif kind == "truncated":
        data = good.read_bytes()
        p.write_bytes(data[: len(data) // 2])
    elif kind == "missing-weights":
        import numpy as np

        w = onnx.numpy_helper.from_array(np.array([1.0, 2.0], np.float32), "w")
        graph = helper.make_graph([helper.make_node("Add", ["x", "w"], ["y"])], "g", [x], [y], [w])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        onnx.save(
            model, str(p), save_as_external_data=True, location="weights.bin", size_threshold=0
        )
        (tmp_path / "weights.bin").unlink()
    elif kind == "checker":
        graph = helper.make_graph([helper.make_node("Add", ["x", "nope"], ["y"])], "g", [x], [y])
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), p)
    elif kind == "old-opset":  # Upsample was removed: opset 23 cannot hold it
        s = helper.make_tensor_value_info("s", TensorProto.FLOAT, [1])
        node = helper.make_node("Upsample", ["x", "s"], ["y"], mode="nearest")
        graph = helper.make_graph([node], "g", [x, s], [y])
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 9)]), p)
    elif kind == "future-opset":
        graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 99)]), p)
    return p


BAD_ONNX = {
    "not-onnx": "not a readable ONNX model",
    "truncated": "not a readable ONNX model",
    "missing-weights": "keep the .onnx and its external data files together",
    "checker": "onnxruntime cannot load",
    "old-opset": "",  # accepted now: see test_bad_onnx_input
    "future-opset": "upgrade onnx",
}


@pytest.mark.parametrize("kind", list(BAD_ONNX))
@pytest.mark.parametrize("command", ["optimize", "inspect"])
def test_bad_onnx_input(cli, files, tmp_path, kind, command):
    src = _bad_onnx(kind, tmp_path)
    out = tmp_path / "out" / "o.onnx"
    before = files(tmp_path)
    args = ["optimize", src, "--out", out] if command == "optimize" else ["inspect", src]
    code, _, err = cli(*args)
    if kind == "old-opset":
        # a valid opset-9 graph that onnxruntime loads: optimize upgrades it with onnx's
        # version converter (Upsample -> Resize), inspect reads it as it is
        assert code == 0
        return
    assert code == 1
    assert BAD_ONNX[kind] in _one_line_error(err)
    assert files(tmp_path) == before  # no output, not even a temp folder, and input untouched


# ---- 6. a number out of range: argparse's usage error ----------------------------------
@pytest.mark.parametrize(
    "args, flag",
    [
        (["generate", "A", "--prompt-ids", "1", "--threads", "-3"], "--threads"),
        (["generate", "A", "--prompt-ids", "1", "--max-new-tokens", "0"], "--max-new-tokens"),
        (["generate", "A", "--prompt-ids", "1", "--top-p", "1.5"], "--top-p"),
        (["generate", "A", "--prompt-ids", "1", "--temperature", "0"], "--temperature"),
        (["generate", "A", "--prompt-ids", "1", "--temperature", "nan"], "--temperature"),
        (["generate", "A", "--prompt-ids", "1", "--num-draft", "0"], "--num-draft"),
        (["generate", "A", "--prompt-ids", "1", "--seed", "-1"], "--seed"),
        (["generate", "A", "--prompt-ids", "1", "--provider", "tpu"], "--provider"),
        (["chat", "A", "--top-k", "-1"], "--top-k"),
        (["export", "M", "--out", "O", "--layers", "0"], "--layers"),
        (["export", "M", "--out", "O", "--max-length", "-5"], "--max-length"),
        (["quantize", "A", "--out", "O", "--scheme", "w4a16", "--calib-docs", "0"], "--calib-docs"),
        (["train-mtp", "A", "--out", "O", "--steps", "0"], "--steps"),
        (["train-mtp", "A", "--out", "O", "--heads", "x"], "--heads"),
        (["bench", "A", "--runs", "0"], "--runs"),
        (["eval", "ppl", "A", "--text", "T", "--chunk", "0"], "--chunk"),
        (["optimize", "m.onnx", "--out", "o.onnx", "--sliding-window", "0"], "--sliding-window"),
        (["demo", "--max-new-tokens", "-1"], "--max-new-tokens"),
    ],
)
def test_number_out_of_range_is_a_usage_error(cli, args, flag):
    code, _, err = cli(*args)
    assert code == 2
    assert "usage: specport" in err and flag in err and "Traceback" not in err


# ---- 7. options that cannot work together: exit 2 before anything loads ----------------
@pytest.mark.parametrize(
    "args, fix",
    [
        (["--kv-layout", "shared", "--target", "cann"], "--kv-layout concat"),
        (["--kv-layout", "shared", "--no-fuse"], "drop --no-fuse"),
        (["--no-fuse", "--passes", "fuse_rotary"], "drop one of them"),
        (["--passes", "fuse_everything"], "choose from"),
        (["--kv-layout", "concat", "--max-length", "64"], "--kv-layout shared"),
        (["--tree-mask", "--kv-layout", "concat", "--passes", "fuse_attention"], "--passes"),
        (["--tokenizer", "{tok}"], "Drop it"),
        # against the model's config, still without weights
        (["--kv-layout", "shared", "--max-length", "100000"], "use 1..128"),
        (["--layers", "5"], "use 1..2"),
    ],
)
def test_export_options_that_cannot_work(cli, files, config_only_model, tmp_path, args, fix):
    tok = tmp_path / "tok.bin"
    tok.write_bytes(b"\0" * 8)
    args = [a.format(tok=tok) for a in args]
    out = tmp_path / "out"
    before = files(config_only_model)
    code, _, err = cli("export", config_only_model, "--out", out, *args)
    assert code == 2, err
    assert fix in _one_line_error(err)
    assert "[1/5]" not in err  # refused before the first stage
    assert not out.exists() and files(config_only_model) == before


def test_shared_layout_refused_for_the_models_head_dim(cli, tmp_path):
    """stories260K's head_dim of 8 cannot run GroupQueryAttention: known from config.json."""
    from transformers import LlamaConfig

    src = tmp_path / "hd8"
    LlamaConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=4).save_pretrained(src)
    code, _, err = cli("export", src, "--out", tmp_path / "o", "--kv-layout", "shared")
    assert code == 2
    line = _one_line_error(err)
    assert "(8, 8)" in line and "--kv-layout concat" in line


@pytest.mark.parametrize(
    "args, fix",
    [
        (["--greedy", "--temperature", "0.7"], "drop --greedy"),
        (["--system", "be brief"], "add --chat"),
        (["--num-draft", "2"], "add --speculative"),
        (["--speculative", "draft"], "--draft DIR"),
        (["--draft", "somewhere"], "--speculative draft"),
        (["--tree-width", "2"], "--speculative ngram"),
        (["--adaptive"], "add --speculative"),
        (["--stop", ""], "non-empty"),
        (["--prompt-ids", "1,x"], "comma-separated integers"),
    ],
)
def test_generate_options_that_cannot_work(cli, tmp_path, args, fix):
    ids = [] if "--prompt-ids" in args else ["--prompt-ids", "1,2"]
    code, _, err = cli("generate", tmp_path / "missing-artifact", *ids, *args)
    assert code == 2  # refused before even looking for the artifact
    assert fix in _one_line_error(err)


@pytest.mark.parametrize("peer", ["llama.cpp+ngram", "onnxruntime-genai+ngram"])
def test_bench_ngram_peer_without_speculative_is_a_usage_error(cli, tmp_path, peer):
    code, _, err = cli("bench", tmp_path / "missing-artifact", "--peer", peer)
    assert code == 2  # refused before even looking for the artifact
    line = _one_line_error(err)
    assert "own speculative decoding" in line and "--speculative ngram" in line


@pytest.mark.parametrize("args", [["--prompt-set", "chat"], ["--prompt", "Hello"]])
def test_plain_bench_refuses_prompts_it_would_not_use(cli, tmp_path, args):
    code, _, err = cli("bench", tmp_path / "missing-artifact", *args)
    assert code == 2  # refused before even looking for the artifact
    assert "plain decode benches a random prompt" in _one_line_error(err)


@pytest.mark.parametrize(
    "args, fix",
    [
        ([], "--scheme"),
        (["--scheme", "w4a16", "--form", "dynamic"], "choose matmulnbits, qdq"),
        (["--scheme", "w4a16", "--algo", "gptq"], "--calib"),
        (["--kv-cache", "int8"], "--calib"),
        (["--scheme", "w4a16", "--kv-granularity", "per_tensor"], "--kv-cache int8"),
    ],
)
def test_quantize_options_that_cannot_work(cli, files, tiny_llama_artifact, tmp_path, args, fix):
    before = files(tiny_llama_artifact)
    code, _, err = cli("quantize", tiny_llama_artifact, "--out", tmp_path / "q", *args)
    assert code == 2
    assert fix in _one_line_error(err)
    assert not (tmp_path / "q").exists() and files(tiny_llama_artifact) == before


# ---- 8. inputs that are missing -------------------------------------------------------
def test_missing_inputs_exit_1_with_the_fix(cli, tiny_llama_artifact, tmp_path):
    code, _, err = cli(
        "quantize", tiny_llama_artifact, "--out", tmp_path / "q", "--scheme", "w8a8",
        "--calib", tmp_path / "nope.txt",
    )  # fmt: skip
    assert code == 1 and "is not a file" in _one_line_error(err)
    code, _, err = cli(
        "train-mtp", tiny_llama_artifact, "--out", tmp_path / "m", "--data", tmp_path / "nope"
    )
    assert code == 1 and "--data" in _one_line_error(err)
    code, _, err = cli("train-mtp", tiny_llama_artifact, "--out", tmp_path / "m")
    assert code == 2 and "--data" in _one_line_error(err)
    code, _, err = cli("generate", tmp_path / "nothing", "--prompt", "hi")
    assert code == 1 and "specport export" in _one_line_error(err)
    code, _, err = cli("export", tmp_path / "nothing", "--out", tmp_path / "o")
    assert code == 1 and "Check the path" in _one_line_error(err)
    assert not (tmp_path / "q").exists() and not (tmp_path / "m").exists()


# ---- 9. options that do not fit the artifact: exit 1 or 2 with the fix ------------------
def test_options_that_do_not_fit_the_artifact(cli, tiny_llama_artifact):
    a = tiny_llama_artifact
    code, _, err = cli("generate", a, "--prompt", "Once")  # no tokenizer
    assert code == 2 and "--prompt-ids" in _one_line_error(err)
    code, _, err = cli("generate", a, "--prompt-ids", "1,2", "--speculative", "mtp")
    assert code == 1 and "specport train-mtp" in _one_line_error(err)
    code, _, err = cli("generate", a, "--prompt-ids", "1,999999")
    assert code == 2 and "vocabulary" in _one_line_error(err)
    code, _, err = cli("chat", a)
    assert code == 1 and "generate --prompt" in _one_line_error(err)
    code, _, err = cli("generate", a, "--chat", "hi")
    assert code == 1 and "--prompt" in _one_line_error(err)
    for command in (("generate", a, "--prompt-ids", "1,2"), ("bench", a)):  # a concat export
        code, _, err = cli(*command, "--speculative", "draft", "--draft", "self")
        assert code in (1, 2) and "--kv-layout shared" in _one_line_error(err), command


# ---- 9b. an artifact copied with hard links (`cp -al`): onnx_ir will not read its weights --
@pytest.mark.parametrize("command", ["quantize", "train-draft", "train-mtp", "optimize"])
def test_hard_linked_weights_are_refused_before_any_work(
    cli, files, tiny_llama_artifact, tmp_path, command
):
    import shutil

    own = shutil.copytree(tiny_llama_artifact, tmp_path / "own")  # the fixture stays unlinked
    linked = tmp_path / "linked"
    shutil.copytree(own, linked, copy_function=os.link)
    (tmp_path / "data.txt").write_text("Once upon a time.\n\nThe end.\n")
    out = tmp_path / "out"
    args = {
        "quantize": ["quantize", linked, "--out", out, "--scheme", "w8a16"],
        "train-draft": ["train-draft", linked, "--out", out],
        "train-mtp": ["train-mtp", linked, "--out", out, "--data", tmp_path / "data.txt"],
        "optimize": ["optimize", linked / "model.onnx", "--out", out / "m.onnx"],
    }[command]
    before = files(tmp_path)
    code, _, err = cli(*args)
    line = _one_line_error(err)
    assert code == 1 and "hard links" in line and "cp -r" in line, line
    assert not out.exists() and files(tmp_path) == before


# ---- 10. global options anywhere, JSON errors -----------------------------------------
def test_verbose_and_quiet_before_or_after_the_command(cli, tmp_path):
    for args in (
        ["-v", "inspect", tmp_path],
        ["inspect", tmp_path, "-v"],
        ["inspect", "-q", tmp_path],
    ):
        code, _, err = cli(*args)
        assert code == 1 and "not a specport artifact" in err


def test_json_error_object_for_usage_errors(cli, config_only_model, tmp_path):
    code, out, _ = cli(
        "export", config_only_model, "--out", tmp_path / "o", "--passes", "x", "--json"
    )
    assert code == 2
    obj = json.loads(out)
    assert obj["type"] == "UsageError" and "--passes" in obj["error"]


def test_a_good_onnx_with_external_weights_elsewhere(
    cli, files, tiny_llama_artifact, tmp_path, monkeypatch
):
    """The checks read external data beside the file (not in the current folder), and an
    earlier `optimize` output may be replaced, while the input never is."""
    monkeypatch.chdir(tmp_path)
    src = tiny_llama_artifact / "model.onnx"
    before = files(tiny_llama_artifact)
    out = tmp_path / "opt" / "opt.onnx"
    for _ in range(2):  # the second run replaces its own earlier output
        code, _, err = cli("optimize", src, "--out", out, "--json")
        assert code == 0, err
    code, out_text, err = cli("inspect", out, "--json")
    assert code == 0, err
    assert json.loads(out_text)["nodes"] > 0
    assert files(tiny_llama_artifact) == before
