"""The load/fault script, bounded: a few requests at concurrency 1 and 4 against the batching
engine (every streamed answer equals its prompt's greedy reference), then each client fault,
after which the server must still answer correctly."""

from __future__ import annotations

import asyncio

import pytest

from specport.bench.loadtest import faults, run_load


@pytest.mark.slow
def test_load_levels_and_faults(bytes_batching):
    model, server = bytes_batching
    name = server.app.state.specport.served.name
    rows = asyncio.run(run_load(server.url, name, [1, 4], 8, 12, "x"))
    for row in rows:
        assert row["requests"] == 8 and row["errors"] == 0 and row["mismatches"] == 0, row
        assert row["output_tokens_per_s"] > 0 and row["ttft_ms"][0] > 0

    def check() -> bool:
        again = asyncio.run(run_load(server.url, name, [2], 2, 8, "x"))
        return again[0]["errors"] == 0 and again[0]["mismatches"] == 0

    outcomes = faults(server.url, name, "", check)
    assert set(outcomes) == {
        "disconnect mid-stream",
        "truncated body",
        "oversized body",
        "garbage bytes",
        "idle connection",
    }
    assert all(o.endswith("serving correctly") for o in outcomes.values()), outcomes
    assert outcomes["oversized body"].startswith("HTTP/1.1 413"), outcomes
    assert outcomes["garbage bytes"].startswith("HTTP/1.1 400"), outcomes


def test_table_and_peer_arguments(capsys):
    from specport.bench.loadtest import table
    from specport.cli import main

    row = {"concurrency": 4, "requests_per_s": 1.5, "output_tokens_per_s": 20.0}
    row |= {"ttft_ms": [1, 2, 3], "itl_ms": [4, 5, 6], "errors": 0, "mismatches": 0}
    text = table([{"server": "llama.cpp", **row, "reconnects": 2}], server=True)
    assert text.splitlines()[0].startswith("| server | concurrency |")
    assert text.splitlines()[2] == (
        "| llama.cpp | 4 | 1.5 | 20.0 | 1 / 2 / 3 | 4 / 5 / 6 | 0 | 0 | 2 |"
    )
    assert main(["loadtest", "--peer", "llama.cpp", "--artifact", "x"]) == 2  # no --gguf
    assert "--gguf" in capsys.readouterr().err


@pytest.mark.slow
def test_soak_short(bytes_batching):
    """The soak script, bounded to a few seconds: every answer equals its reference, the
    server's finished-request counter moved by exactly the client's count, and its resident
    memory is read from /metrics (process collector)."""
    from benchmarks.soak import soak

    model, server = bytes_batching
    name = server.app.state.specport.served.name
    report = asyncio.run(soak(server.url, name, 4, 3.0, 8, "", sample_s=1.0, distinct=6))
    assert report["requests"] > 4 and report["errors"] == 0 and report["mismatches"] == 0
    assert report["metrics_agree"], report
    assert report["rss_mb"]["start"] and report["rss_mb"]["end"] and len(report["rss_samples"]) >= 2
