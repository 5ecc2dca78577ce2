"""The 4-bit speed table (benchmarks/quant_speed_peers.py): ratios are paired per round, the
first engine is the base, and the table names the load it ran under (no timing asserted)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from benchmarks.quant_speed_peers import Decode, Row, default_engines, format_table, summarize


def test_ratios_are_medians_of_per_round_ratios_to_the_first_engine() -> None:
    base = Row("specport:a", "specport", Path("a"), 100)
    peer = Row("genai:b", "genai", Path("b"), 50)
    # round 2 ran while the machine was twice as slow for both: the pair keeps the ratio
    base.runs[1] = [Decode(1.0, 100, 1, 0.5), Decode(2.0, 100, 1, 1.0), Decode(1.0, 100, 1, 0.5)]
    peer.runs[1] = [Decode(2.0, 100, 1, 1.0), Decode(4.0, 100, 1, 2.0), Decode(2.0, 100, 1, 1.0)]
    args = argparse.Namespace(
        prompt_len=128, new_tokens=101, batch=[1], threads=2, rounds=3, seed=0, spin=False
    )
    report = summarize([base, peer], args, params=400, loads=["0.10 0.20 0.30"])
    rows = {r["engine"]: r for r in report["rows"]}
    assert rows["genai:b"]["batch1"]["ratio_to_first"] == 0.5
    assert rows["genai:b"]["batch1"]["cpu_s_per_token"] == 0.01
    assert rows["specport:a"]["bpw_file"] == 2.0  # 100 bytes x 8 over 400 parameters
    table = format_table(report)
    assert "| genai:b | 1.00 |" in table and "0.10 0.20 0.30" in table


def test_default_engines_put_specports_default_first(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="prepare"):
        default_engines(tmp_path)
    for name in ("qspeed-Q4_0.gguf", "qspeed-genai-int4", "qspeed-w4a8"):
        (tmp_path / name).mkdir()
    assert [e.split(":")[0] for e in default_engines(tmp_path)] == ["specport", "genai", "llama"]
