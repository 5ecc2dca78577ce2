"""The kernel-level KV-dtype benchmark runs every variant (a smoke test: no timing asserted)."""

from __future__ import annotations

from benchmarks.kv_cache import VARIANTS, Shapes, main, measure


def test_measure_runs_every_variant(capsys):
    report = measure(Shapes(4, 2, 16, 2), contexts=[8, 16], prefill=12, rounds=2, threads=1)
    for v in VARIANTS:
        assert set(report[v]["decode_ms"]) == {8, 16} and report[v]["prefill_ms"] > 0
    assert report["setup"]["layers"] == 2
    assert main(["--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--layers", "1",
                 "--contexts", "4", "--rounds", "1", "--threads", "1"]) == 0  # fmt: skip
    assert '"int8 per_channel"' in capsys.readouterr().out
