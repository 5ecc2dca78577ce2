"""The load/fault script, bounded: a few requests at concurrency 1 and 4 against the batching
engine (every streamed answer equals its prompt's greedy reference), then each client fault,
after which the server must still answer correctly."""

from __future__ import annotations

import asyncio
import json

import numpy as np
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


def test_workload_lengths_prefix_and_arrivals(tmp_path):
    from specport.bench.arrivals import arrival_offsets
    from specport.bench.workload import build

    items = build(200, 4.0, (10, 30), (5, 9), shared_prefix=0.5, seed=3)
    assert items == build(200, 4.0, (10, 30), (5, 9), shared_prefix=0.5, seed=3)
    words = [i.prompt.split() for i in items]
    assert all(10 <= len(w) <= 30 for w in words)
    assert all(5 <= i.max_tokens <= 9 for i in items)
    assert len({tuple(w[:5]) for w in words}) == 1  # the common prefix: half the shortest
    assert len({tuple(w[:6]) for w in words}) == 200  # then each its own
    at = [i.at for i in items]
    assert at == sorted(at) and at[0] == 0.0 and 200 / 4.0 * 0.7 < at[-1] < 200 / 4.0 * 1.3
    # burstier arrivals: the same mean rate, gaps far more uneven
    poisson = np.diff(arrival_offsets(2000, 4.0, 0))
    bursty = np.diff(arrival_offsets(2000, 4.0, 0, burstiness=0.2))
    assert abs(bursty.mean() - 0.25) < 0.05 and bursty.std() > 1.8 * poisson.std()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hello there", "max_tokens": 7}\n{"prompt": "bye"}\n')
    from_file = build(3, None, (1, 1), (4, 4), prompts_file=str(prompts))
    assert [(i.prompt, i.max_tokens) for i in from_file] == [
        ("hello there", 7), ("bye", 4), ("hello there", 7)
    ]  # fmt: skip


@pytest.mark.slow
def test_rate_sweep_against_the_server(bytes_batching, tiny_server, capsys):
    """`loadtest --rate`: every request answered at each rate with its latencies and goodput;
    a server that refuses them (token ids only, text sent) shows up as errors by kind."""
    from specport.cli import main

    _, server = bytes_batching
    name = server.app.state.specport.served.name
    args = ["--requests", "6", "--prompt-len", "2:5", "--answer-len", "3:6", "--json"]
    assert main(["loadtest", server.url, "--model", name, "--rate", "40,inf", *args]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["rate"] for r in rows] == [40.0, "inf"]
    for r in rows:
        assert r["completed"] == 6 and r["errors"] == {}, r
        assert all(v is not None for v in r["ttft_ms"] + r["tpot_ms"]), r
        assert r["slo_met"] == 1.0 and r["goodput_requests_per_s"] == r["requests_per_s"]
    assert main(["loadtest", tiny_server.url, "--model", "tiny", "--rate", "inf", *args]) == 0
    (row,) = json.loads(capsys.readouterr().out)["rows"]
    assert row["completed"] == 0 and row["errors"] == {"http 400": 6}
