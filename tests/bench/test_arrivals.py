"""`bench --requests N --request-rate R`: requests arriving over time (seeded Poisson), each
request's latency from its own arrival, and speculation still giving plain greedy's tokens."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from specport.bench.arrivals import arrival_offsets, latency_summary, serve_load
from specport.core.errors import InputError

GAP = 0.5  # seconds between arrivals: far above a tiny model's TTFT, far below a timeout


def test_arrivals_are_a_seeded_poisson_process():
    """The first request at 0, exponential gaps of mean 1/rate, the same schedule per seed."""
    times = arrival_offsets(4000, rate=8.0, seed=3)
    assert times[0] == 0.0 and times == sorted(times)
    assert times == arrival_offsets(4000, rate=8.0, seed=3)
    assert times != arrival_offsets(4000, rate=8.0, seed=4)
    gaps = np.diff(times)
    assert abs(gaps.mean() - 1 / 8) < 0.01 and abs(gaps.std() - 1 / 8) < 0.01  # exponential
    assert arrival_offsets(3, None) == arrival_offsets(3, math.inf) == [0.0, 0.0, 0.0]
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(InputError, match="request rate"):
            arrival_offsets(3, bad)


@pytest.mark.slow  # exports the tiny shared Llama, then ~3 s of arrivals
def test_staggered_speculation_equals_plain_and_ttft_counts_from_arrival(tiny_zoo):
    """Copy prompts arriving GAP s apart: the n-gram speculating engine gives every request the
    plain engine's tokens (and Model.generate's), and each TTFT is from that request's arrival,
    so even the last one (arriving 3 x GAP after the start) has a TTFT below GAP."""
    import specport
    from specport.runtime.engine.batching import BatchingEngine

    model = specport.load(tiny_zoo.shared("llama"), threads=1)
    half = [[5, 17, 42, 9, 60, 61], [7, 8, 9, 10], [200, 3, 9, 200, 11], [30, 31, 32]]
    prompts = [[1, *h, *h] for h in half]
    offsets = [i * GAP for i in range(len(prompts))]
    want = [
        model.generate(prompt_ids=p, max_new_tokens=20, ignore_eos=True).tokens for p in prompts
    ]
    plain = BatchingEngine(model, max_batch=4, max_length=96)
    spec = BatchingEngine(model, max_batch=4, max_length=96, speculative="ngram", spec_max_rows=8)
    try:
        serve_load(spec, prompts, 4)  # warm-up: the step-cost calibration stays out of TTFT
        runs = {name: serve_load(eng, prompts, 20, offsets) for name, eng in
                (("plain", plain), ("speculative", spec))}  # fmt: skip
        assert spec.stats()["spec_draft_tokens"] > 0
    finally:
        plain.close()
        spec.close()
    assert runs["plain"]["tokens"] == want
    assert runs["speculative"]["tokens"] == want
    for run in runs.values():
        assert run["wall_s"] >= offsets[-1]
        for at, s in zip(offsets, run["served"]):
            assert s.arrival_s == at and s.tokens == 20
            assert 0 < s.ttft_s < GAP and s.ttft_s <= s.e2e_s < run["wall_s"] - at + 1e-6
            assert s.tpot_s is not None and s.tpot_s > 0
        summary = latency_summary([run])
        assert summary["requests"] == 4
        assert summary["ttft_ms_p99"] >= summary["ttft_ms_p50"] > 0
        assert summary["e2e_ms_p99"] >= summary["e2e_ms_p50"] >= summary["ttft_ms_p50"]
        assert summary["output_tok_per_s"] == pytest.approx(80 / run["wall_s"], rel=0.01)


def _bench(capsys, *args: str) -> tuple[int, str, str]:
    from specport.cli import main

    try:
        code = main(["bench", *args])
    except SystemExit as e:  # argparse's usage errors
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.slow  # exports the tiny shared Llama (shared with the test above)
def test_bench_request_rate_reports_latency_per_engine(tiny_zoo, capsys):
    """`bench --requests 3 --speculative ngram --request-rate R --json`: the seeded schedule,
    TTFT / TPOT / E2E p50 / p99 and output tok/s for both engines, and the same tokens."""
    art = str(tiny_zoo.shared("llama"))
    common = ["--requests", "3", "--new-tokens", "8", "--prompt-len", "12", "--runs", "2"]
    common += ["--prefix-tokens", "20"]  # the tiny model holds 128 positions
    code, out, _ = _bench(
        capsys, art, *common, "--speculative", "ngram", "--request-rate", "40", "--seed", "2",
        "--threads", "1", "--json",
    )  # fmt: skip
    assert code == 0
    report = json.loads(out)
    assert report["config"]["request_rate"] == 40.0
    assert report["arrivals_s"] == [round(t, 4) for t in arrival_offsets(3, 40.0, 2)]
    assert report["same_tokens"] is True
    for name in ("plain", "speculative"):
        lat = report["latency"][name]
        assert lat["requests"] == 6  # 3 requests x 2 rounds
        for key in ("ttft_ms", "e2e_ms"):
            assert lat[f"{key}_p99"] >= lat[f"{key}_p50"] > 0, (name, key)
        # a tiny model's tokens may reach the handle in one event: TPOT rounds to 0.0 ms
        assert lat["tpot_ms_p99"] >= lat["tpot_ms_p50"] >= 0
        assert lat["output_tok_per_s"] > 0
        assert report[f"{name}_ttft_ms_p50"] == lat["ttft_ms_p50"]
    code, out, _ = _bench(capsys, art, *common, "--request-rate", "40", "--threads", "1")
    assert code == 0
    assert "3 requests arriving at 40/s (Poisson, seed 0)" in out
    assert "same tokens: True" in out and "TPOT" in out and "E2E" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--requests", "2", "--request-rate", "0"], "must be > 0"),
        (["--requests", "2", "--request-rate", "nan"], "must be > 0"),
        (["--requests", "2", "--request-rate", "-3"], "must be > 0"),
        (["--requests", "2", "--request-rate", "fast"], "must be a number"),
        (["--request-rate", "2"], "add --requests N"),
    ],
)
def test_bench_request_rate_usage_errors(capsys, args, message):
    """A bad rate, or a rate without --requests: exit 2 with one line saying what to fix."""
    code, _, err = _bench(capsys, "no-such-artifact", *args)
    assert code == 2
    assert message in err and "Traceback" not in err
