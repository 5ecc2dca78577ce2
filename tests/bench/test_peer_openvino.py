"""OpenVINO GenAI as a bench peer, without OpenVINO: names, the venv and export commands, the
worker's answers and the one-line errors users see."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from specport.bench import peer_openvino as ov
from specport.bench.peers import check_peer_name
from specport.bench.spec_peers import check_spec_peer_name
from specport.core.errors import InputError, SpecportError


def test_peer_names_give_precision_and_mode() -> None:
    assert ov.parse_name("openvino-genai") == ov.PeerName("f32", "plain")
    assert ov.parse_name("openvino-genai:default") == ov.PeerName("default", "plain")
    assert ov.parse_name("openvino-genai+lookup") == ov.PeerName("f32", "lookup")
    assert ov.parse_name("openvino-genai:default+draft") == ov.PeerName("default", "draft")
    for bad in ("openvino-genai:bf16", "openvino-genai+ngram", "openvino-genai+lookup+draft"):
        with pytest.raises(InputError, match=r"openvino-genai\[:f32\|:default\]"):
            ov.parse_name(bad)


def test_bench_and_speculative_bench_accept_their_names() -> None:
    assert check_peer_name("openvino-genai:default") == "openvino-genai:default"
    with pytest.raises(InputError, match="--speculative"):
        check_peer_name("openvino-genai+lookup")  # its speculation needs the speculative bench
    assert check_spec_peer_name("openvino-genai") == ("openvino-genai", False)
    assert check_spec_peer_name("openvino-genai:default+lookup") == (
        "openvino-genai:default+lookup",
        True,
    )
    with pytest.raises(InputError):
        check_spec_peer_name("openvino-genai+ngram")


def test_plain_bench_refuses_speculative_peer_with_usage_error(capsys) -> None:
    from specport.cli import main

    assert main(["bench", "no-such-artifact", "--peer", "openvino-genai+draft"]) == 2
    err = capsys.readouterr().err
    assert "+draft peers are the peer's own speculative decoding" in err
    assert "Traceback" not in err


def test_precision_rows_set_exact_fp32_or_nothing() -> None:
    assert ov.load_properties("f32", 2) == {
        "INFERENCE_NUM_THREADS": 2,
        "INFERENCE_PRECISION_HINT": "f32",
        "KV_CACHE_PRECISION": "f32",
    }
    assert ov.load_properties("default", 2) == {"INFERENCE_NUM_THREADS": 2}


def test_venv_lives_in_specport_cache_unless_overridden(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("SPECPORT_OPENVINO_VENV", raising=False)
    monkeypatch.setenv("SPECPORT_CACHE", str(tmp_path))
    assert ov.venv_dir() == tmp_path / "venvs" / "openvino-genai"
    monkeypatch.setenv("SPECPORT_OPENVINO_VENV", str(tmp_path / "mine"))
    assert ov.venv_dir() == tmp_path / "mine"


def test_setup_installs_cpu_torch_first_and_keeps_it(tmp_path) -> None:
    venv = tmp_path / "v"
    cmds = ov.setup_commands(venv, tmp_path / "c.txt")
    assert cmds[0] == [sys.executable, "-m", "venv", str(venv)]
    assert cmds[1][-1].startswith("torch==")  # the CPU torch first ...
    assert cmds[2][cmds[2].index("-c") + 1] == str(tmp_path / "c.txt")  # ... kept by constraint
    assert "openvino-genai" in cmds[2] and "optimum-intel[openvino]" in cmds[2]
    assert cmds[3][-1] == "torchvision"
    hint = ov.setup_hint(venv)
    assert hint.startswith(f"python -m venv {venv}") and ov.READY in hint


def test_failed_venv_creation_is_one_line_naming_the_command(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SPECPORT_OPENVINO_VENV", str(tmp_path / "venv"))
    failing = [[sys.executable, "-c", "import sys; print('no network: pip failed'); sys.exit(1)"]]
    monkeypatch.setattr(ov, "setup_commands", lambda venv, constraints: failing)
    with pytest.raises(SpecportError) as info:
        ov.ensure_venv(progress=False)
    message = str(info.value)
    assert "\n" not in message
    assert "no network: pip failed" in message
    assert f"python -m venv {tmp_path / 'venv'}" in message


def test_ready_venv_is_used_as_is(tmp_path, monkeypatch) -> None:
    venv = tmp_path / "venv"
    monkeypatch.setenv("SPECPORT_OPENVINO_VENV", str(venv))
    python = ov.venv_python(venv)
    python.parent.mkdir(parents=True)
    python.write_text("")
    (venv / ov.READY).write_text("{}")
    monkeypatch.setattr(ov, "setup_commands", lambda *a: pytest.fail("must not re-create"))
    assert ov.ensure_venv(progress=False) == python


def test_export_command_follows_the_weight_format(tmp_path) -> None:
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"hidden_size": 576, "intermediate_size": 1536}))
    cli = Path("/v/bin/optimum-cli")
    cmd = ov.export_command(cli, hf, tmp_path / "out", "fp32")
    assert cmd[:3] == [str(cli), "export", "openvino"]
    assert cmd[cmd.index("--task") + 1] == "text-generation-with-past"
    assert cmd[cmd.index("--weight-format") + 1] == "fp32" and "--group-size" not in cmd
    int4 = ov.export_command(cli, hf, tmp_path / "out", "int4")
    assert int4[int4.index("--group-size") + 1] == "64"  # 128 does not divide 576


@pytest.mark.parametrize(
    ("scheme", "fmt"), [(None, "fp32"), ("w8a8", "int8"), ("w8a16", "int8"), ("w4a8", "int4")]
)
def test_weight_format_matches_the_artifact(scheme, fmt) -> None:
    manifest = SimpleNamespace(quant={"scheme": scheme} if scheme else None)
    assert ov.weight_format(manifest) == fmt  # type: ignore[arg-type]


def test_worker_answers_are_parsed_or_named() -> None:
    answer = {"tokens": [5, 6, 7], "t_start": 1.0, "t_first": 1.5, "t_end": 2.5, "writes": 2}
    tokens, decode, runs, cpu = ov.run_result(ov.parse_answer(json.dumps(answer) + "\n", "run"))
    assert (tokens, decode, runs, cpu) == ([5, 6, 7], 1.0, 2, None)  # an older worker's answer
    answer |= {"c_first": 3.0, "c_end": 4.75}  # the worker's CPU seconds over the decode
    assert ov.run_result(answer)[3] == 1.75
    with pytest.raises(SpecportError, match=r"OpenVINO GenAI failed \(load\): RuntimeError: x"):
        ov.parse_answer('{"error": "RuntimeError: x"}', "load")
    with pytest.raises(SpecportError, match="exited during 'run'"):
        ov.parse_answer("", "run")
    with pytest.raises(SpecportError, match="not JSON"):
        ov.parse_answer("Traceback (most recent call last):", "run")
    with pytest.raises(SpecportError, match="lacks"):
        ov.run_result({"tokens": [1]})


def test_draft_peer_without_draft_artifact_says_what_to_pass(monkeypatch) -> None:
    monkeypatch.setattr(ov, "ensure_venv", lambda progress=None: pytest.fail("too late"))
    config = SimpleNamespace(threads=2, draft=None)
    with pytest.raises(InputError, match="needs --draft ARTIFACT"):
        ov.OpenVinoPeer(SimpleNamespace(), config, "openvino-genai+draft")  # type: ignore[arg-type]


def test_worker_speaks_json_lines_and_reports_errors_without_openvino(tmp_path) -> None:
    """The worker script runs under any Python: without a model it answers errors as JSON."""
    requests = ['{"op": "run", "ids": [1], "new_tokens": 2}', '{"op": "nope"}', "not json"]
    out = subprocess.run(
        [sys.executable, str(ov.WORKER)],
        input="\n".join([*requests, '{"op": "quit"}']) + "\n",
        capture_output=True,
        text=True,
        timeout=60,
    )
    answers = [json.loads(line) for line in out.stdout.splitlines()]
    assert answers[0] == {"error": "no model loaded"}
    assert answers[1] == {"error": "unknown op 'nope'"}
    assert answers[2]["error"].startswith("JSONDecodeError")
