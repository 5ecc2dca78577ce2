"""`specport eval compare A B C --plot FILE`: every further artifact is scored against the first
in one run, and the chart puts each at its weights' bits with its perplexity."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specport.cli import main
from specport.passes.quant.apply import quantize_artifact

pytest.importorskip("matplotlib")


@pytest.mark.slow
def test_compare_several_and_plot(quant_src: Path, eval_text: Path, tmp_path: Path, capsys) -> None:
    w8, w4 = tmp_path / "w8", tmp_path / "w4"
    quantize_artifact(quant_src, w8, scheme="w8a16", algo="rtn")
    quantize_artifact(quant_src, w4, scheme="w4a16", algo="rtn")
    chart = tmp_path / "quality.svg"
    argv = ["eval", "compare", str(quant_src), str(w8), str(w4), "--text", str(eval_text)]
    assert main([*argv, "--plot", str(chart), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = out["compared"]
    assert [r["other"] for r in rows] == [str(w8), str(w4)]
    assert rows[0]["ppl_a"] == pytest.approx(rows[1]["ppl_a"])  # one reference for both
    svg = chart.read_text()
    assert "w8 (w8a16 rtn)" in svg and "w4 (w4a16 rtn)" in svg and "perplexity" in svg
    # one artifact compared: the JSON stays the single object it always was
    assert (
        main(["eval", "compare", str(quant_src), str(w8), "--text", str(eval_text), "--json"]) == 0
    )
    assert "top1_agreement" in json.loads(capsys.readouterr().out)
    # an existing chart is never replaced, and that is said before any scoring
    assert main([*argv, "--plot", str(chart)]) == 2
    assert "exists" in capsys.readouterr().err
