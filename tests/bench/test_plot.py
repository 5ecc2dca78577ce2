"""Charts (specport/bench/plot.py) draw what the tables say: each chart is checked by reading
the numbers back out of its SVG (bar heights and line points are in the file), and a bad
--plot name is refused before any measurement starts."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from specport.bench import plot  # noqa: E402
from specport.cli import main  # noqa: E402
from specport.core.errors import UsageError  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _spec_report() -> dict:
    rows = [
        {"engine": "plain", "decode_tok_per_s": 100.0, "speedup_vs_plain": 1.0},
        {"engine": "ngram", "decode_tok_per_s": 150.0, "speedup_vs_plain": 1.5},
        {"engine": "mtp", "decode_tok_per_s": 210.0, "speedup_vs_plain": 2.1},
    ]
    return {"rows": rows, "prompts": 4, "max_new_tokens": 64, "num_draft": 3}


def test_speculative_chart_labels_every_method_with_its_speedup(tmp_path: Path) -> None:
    out = plot.bench_chart([_spec_report()], tmp_path / "spec.svg")
    svg = out.read_text()
    for label in ("plain", "ngram", "mtp", "1.50x", "2.10x"):
        assert label in svg
    assert "Date" not in svg  # no timestamp: same numbers, same file


def test_plain_chart_has_a_bar_per_engine_and_batch(tmp_path: Path) -> None:
    def report(batch: int, ours: float, peer: float) -> dict:
        engines = {
            "specport": {"decode_tok_per_s": ours},
            "onnxruntime-genai": {"decode_tok_per_s": peer},
        }
        config = {"batch": batch, "prompt_len": 32, "new_tokens": 64, "runs": 3}
        return {"engines": engines, "config": config, "hardware": {"load_average": 1.0}}

    out = plot.bench_chart([report(1, 40.0, 45.0), report(8, 130.0, 90.0)], tmp_path / "b.png")
    assert out.read_bytes()[:8] == PNG_MAGIC
    svg = plot.bench_chart([report(1, 40.0, 45.0), report(8, 130.0, 90.0)], tmp_path / "b.svg")
    text = svg.read_text()
    for label in ("batch 1", "batch 8", "specport", "onnxruntime-genai", ">130<", ">45<"):
        assert label in text


def test_load_chart_plots_throughput_and_ttft_per_server(tmp_path: Path) -> None:
    rows = [
        {"server": s, "concurrency": c, "output_tokens_per_s": t, "ttft_ms": [p50, 0, p99]}
        for s, c, t, p50, p99 in [
            ("specport", 1, 70.0, 10.0, 12.0),
            ("specport", 4, 160.0, 30.0, 50.0),
            ("llama.cpp", 1, 30.0, 40.0, 80.0),
            ("llama.cpp", 4, 31.0, 400.0, 900.0),
        ]
    ]
    series = plot.load_points(rows)
    assert series["specport"][1] == {
        "concurrency": 4,
        "output_tok_per_s": 160.0,
        "ttft_ms_p50": 30.0,
        "ttft_ms_p99": 50.0,
    }
    text = plot.load_chart(series, tmp_path / "load.svg", "t").read_text()
    for label in ("specport p50", "specport p99", "llama.cpp p99", "concurrent requests"):
        assert label in text


def test_quality_chart(tmp_path: Path) -> None:
    points = [
        {"label": "fp32 (float32)", "bits": 32.0, "ppl": 5.26},
        {"label": "w8 (w8a8)", "bits": 8.0, "ppl": 5.27},
        {"label": "w4 (w4a8)", "bits": 4.0, "ppl": 5.49},
    ]
    text = plot.quality_chart(points, tmp_path / "q.svg", "text").read_text()
    assert "w4 (w4a8)" in text and "perplexity" in text


def test_plot_path_is_checked_before_any_work(tmp_path: Path, capsys) -> None:
    with pytest.raises(UsageError, match="png or .svg"):
        plot.check_plot_path(tmp_path / "chart.pdf")
    existing = tmp_path / "chart.png"
    existing.write_bytes(b"mine")
    with pytest.raises(UsageError, match="exists"):
        plot.check_plot_path(existing)
    assert existing.read_bytes() == b"mine"  # never replaced
    with pytest.raises(UsageError, match="does not exist"):
        plot.check_plot_path(tmp_path / "no" / "chart.svg")
    # the command refuses with exit 2 before it opens the (missing) artifact
    assert main(["bench", str(tmp_path / "missing"), "--plot", str(existing)]) == 2
    assert "exists" in capsys.readouterr().err


def test_loadtest_command_checks_its_arguments(tmp_path: Path, capsys) -> None:
    assert main(["loadtest", "http://127.0.0.1:9", "--model", "m", "--concurrency", "0"]) == 2
    assert "--concurrency" in capsys.readouterr().err
    assert main(["loadtest", "http://127.0.0.1:9"]) == 2  # no --model
    assert "--model" in capsys.readouterr().err
    bad = tmp_path / "x.pdf"
    assert main(["loadtest", "http://127.0.0.1:9", "--model", "m", "--plot", str(bad)]) == 2
    assert not bad.exists()


def test_bench_requests_runs_each_count_and_plots_against_concurrency(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """`bench --requests 1 4 --plot`: one engine bench per count, one chart of them all."""
    import json

    from specport.bench import engine

    seen: list[int] = []

    def fake(artifact: str, config) -> dict:
        seen.append(config.requests)
        summary = {"output_tok_per_s": 10.0 * config.requests, "ttft_ms_p50": 1.0}
        summary["ttft_ms_p99"] = 2.0 * config.requests
        return {"config": {"requests": config.requests, "new_tokens": 8, "threads": 1, "rounds": 1},
                "latency": {"batching": summary, "serial": dict(summary, output_tok_per_s=5.0)}}  # fmt: skip

    monkeypatch.setattr(engine, "run_engine_bench", fake)
    chart = tmp_path / "load.svg"
    argv = ["bench", "art", "--requests", "1", "4", "--plot", str(chart), "--json"]
    assert main(argv) == 0
    assert seen == [1, 4]
    out = json.loads(capsys.readouterr().out)
    assert [r["config"]["requests"] for r in out["requests"]] == [1, 4]
    text = chart.read_text()
    assert "batching p99" in text and "serial p50" in text and ">4<" in text
