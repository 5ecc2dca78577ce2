"""The README's quick start runs end to end, as written, on the built-in demo model.

The block is read from README.md (the ```bash block under "## Quick start") and each command is
run with two substitutions only: the GGUF path becomes a tiny demo model (a Hugging Face
directory, trained for a few steps, with a chat template added), and `serve --port 8000`
becomes `--port 0 --json` so the test finds the port. The `curl` request of the next block is
sent with the same body. Everything runs in a temporary directory, as a user's shell would.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.cli.readme_commands import README, Command, bash_blocks

TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def _quick_start() -> tuple[list[Command], list[Command]]:
    """The quick-start block's commands and the curl block after it."""
    lines = README.read_text(encoding="utf-8").splitlines()
    heading = lines.index("## Quick start") + 1
    blocks = [b for b in bash_blocks(README) if b.start > heading]
    return blocks[0].commands, blocks[1].commands


def test_quick_start_is_five_commands() -> None:
    commands, curl = _quick_start()
    assert [c.argv[0] for c in commands] == ["export", "chat", "generate", "quantize", "serve"]
    assert all(c.program == "specport" for c in commands)
    assert "--speculative" in commands[2].argv
    assert curl[0].program == "curl"


@pytest.fixture()
def demo_chat_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A tiny demo model (a few training steps) with a chat template, as a HF directory."""
    from specport.samples.demo_model import ensure_demo_model
    from tests.samples.test_demo_model import TINY

    monkeypatch.setenv("SPECPORT_CACHE", str(tmp_path / "cache"))
    model = ensure_demo_model(progress=False, config=TINY)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    return model


def _run(argv: list[str], cwd: Path, stdin: str = "") -> str:
    done = subprocess.run(
        [sys.executable, "-m", "specport", *argv],
        cwd=cwd,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "SPECPORT_HUGE_PAGES": "0"},
    )
    assert done.returncode == 0, f"specport {shlex.join(argv)}:\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.mark.slow
def test_quick_start_runs_on_the_demo_model(demo_chat_model: Path, tmp_path: Path) -> None:
    commands, curl = _quick_start()
    gguf = commands[0].argv[1]
    work = tmp_path / "work"
    work.mkdir()

    def argv_of(cmd: Command) -> list[str]:
        return [str(demo_chat_model) if a == gguf else a for a in cmd.argv]

    export, chat, generate, quantize, serve = (argv_of(c) for c in commands)
    _run(export, work)
    assert (work / "smollm" / "specport.json").is_file()
    said = _run(chat, work, stdin="Hello there\n/exit\n")
    assert said.strip(), "chat printed no answer"
    result = json.loads(_run(generate, work))
    assert result["tokens"] and result["metrics"]["speculative"]["drafted"] >= 0
    _run(quantize, work)
    assert json.loads((work / "smollm-w4" / "specport.json").read_text())["quant"]["scheme"]

    port = serve.index("--port")
    serve[port + 1] = "0"
    proc = subprocess.Popen(
        [sys.executable, "-m", "specport", *serve, "--json"],
        cwd=work,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        assert line, proc.communicate(timeout=60)[1]
        info = json.loads(line)
        args = list(curl[0].argv)
        url = next(a for a in args if a.startswith("http://127.0.0.1:8000"))
        body = json.loads(args[args.index("-d") + 1])
        reply = httpx.post(
            url.replace("http://127.0.0.1:8000", info["url"]), json=body, timeout=120
        )
        assert reply.status_code == 200, reply.text
        answer = reply.json()
        assert (
            answer["model"] == "smollm-w4"
            and answer["choices"][0]["message"]["role"] == "assistant"
        )
    finally:
        proc.terminate()
        proc.communicate(timeout=60)
