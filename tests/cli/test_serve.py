"""`specport serve`: load errors exit 1 with a message; a real process serves and stops on Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request

from specport.cli import main


def test_missing_artifact_exits_1(capsys, tmp_path):
    assert main(["serve", str(tmp_path / "nothing"), "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err


def test_unknown_provider_exits_1(capsys, tiny_llama_artifact):
    assert main(["serve", str(tiny_llama_artifact), "--provider", "tpu", "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert "error: " in err and "tpu" in err and "Traceback" not in err


def test_bad_port_exits_1(capsys, tiny_llama_artifact):
    assert main(["serve", str(tiny_llama_artifact), "--port", "70000"]) == 1
    assert "--port" in capsys.readouterr().err


def test_serves_then_stops_cleanly_on_ctrl_c(tiny_llama_artifact):
    cmd = [sys.executable, "-m", "specport", "serve", str(tiny_llama_artifact)]
    cmd += ["--port", "0", "--threads", "1", "--model-name", "tiny", "--json"]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ)
    )
    try:
        line = proc.stdout.readline()  # written once the socket is bound
        assert line, proc.stderr.read()
        info = json.loads(line)
        assert info["model"] == "tiny" and info["url"].startswith("http://127.0.0.1:")
        with urllib.request.urlopen(info["url"] + "/health", timeout=30) as r:
            assert r.status == 200
        req = urllib.request.Request(
            info["url"] + "/v1/completions",
            data=json.dumps({"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            body = json.loads(r.read())
        assert body["model"] == "tiny" and body["usage"]["prompt_tokens"] == 3
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode == 0, err
    assert "serving tiny at http://127.0.0.1:" in err and "shutting down" in err
    assert "Traceback" not in err


def test_batching_engine_on_concat_artifact_exits_1(capsys, tiny_llama_artifact):
    rc = main(["serve", str(tiny_llama_artifact), "--engine", "batching", "--port", "0"])
    assert rc == 1
    err = capsys.readouterr().err
    assert "--kv-layout shared" in err and "Traceback" not in err


def test_port_in_use_exits_1(capsys, tiny_llama_artifact):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        assert main(["serve", str(tiny_llama_artifact), "--port", str(port)]) == 1
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and "--port" in err
