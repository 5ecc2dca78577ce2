import json
import subprocess
import sys

import pytest

from specport.cli import main


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "specport", *args], capture_output=True, text=True, timeout=300
    )


def test_help_lists_commands(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for cmd in ("demo", "export", "inspect", "generate"):
        assert cmd in out


def test_version_via_python_dash_m():
    r = _cli("--version")
    assert r.returncode == 0 and r.stdout.startswith("specport ")


def test_usage_error_exits_2():
    r = _cli("generate")
    assert r.returncode == 2
    assert "usage" in r.stderr


def test_missing_artifact_exits_1_with_fix(tmp_path):
    r = _cli("inspect", str(tmp_path / "nope"))
    assert r.returncode == 1
    assert "specport export" in r.stderr


def test_json_error_object(tmp_path):
    r = _cli("inspect", str(tmp_path / "nope"), "--json")
    assert r.returncode == 1
    obj = json.loads(r.stdout)
    assert obj["type"] == "ArtifactError"


@pytest.mark.parametrize(
    "command",
    [
        "demo", "export", "inspect", "generate", "chat", "serve", "optimize", "quantize",
        "eval", "eval ppl", "eval compare", "bench", "train-mtp",
    ],
)  # fmt: skip
def test_every_command_has_help_with_global_options(capsys, command):
    with pytest.raises(SystemExit) as e:
        main([*command.split(), "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "-v, --verbose" in out and "-q, --quiet" in out


@pytest.mark.parametrize("args", [[], ["eval"], ["nonsense"], ["inspect"]])
def test_incomplete_commands_are_usage_errors(capsys, args):
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2 and "usage: specport" in capsys.readouterr().err
