"""The prefill benchmark runs every artifact and chunk size (a smoke test: no timing asserted)."""

from __future__ import annotations

from benchmarks.prefill_speed import main, measure


def test_every_artifact_and_chunk_is_timed(tiny_llama_artifact, capsys):
    art = str(tiny_llama_artifact)
    times = measure([art], tokens=20, chunks=[0, 8], rounds=2, threads=1)
    assert set(times) == {(art, 0), (art, 8)} and all(len(t) == 2 for t in times.values())
    assert (
        main([art, "--tokens", "12", "--chunks", "0", "5", "--rounds", "1", "--threads", "1"]) == 0
    )
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(f"| {art}")]
    assert [row.split(" | ")[1] for row in rows] == ["12", "5"]
