"""`specport demo` ends with what to take away: each speculation method's measured speed
against plain decoding, the best first, a one-line reason for a method that loses, and the
next commands to try on the demo's own artifacts."""

from __future__ import annotations

from pathlib import Path

from specport.samples.demo import next_commands, print_report, takeaway

STAGES = [
    {"stage": "fp32", "ttft_ms": 1.0, "decode_tok_per_s": 1000.0},
    {
        "stage": "speculative-ngram",
        "ttft_ms": 1.0,
        "decode_tok_per_s": 500.0,
        "mean_accepted_length": 1.4,
        "tokens_equal_plain": True,
    },
    {"stage": "plain (base graph)", "ttft_ms": 1.0, "decode_tok_per_s": 900.0},
    {
        "stage": "speculative-mtp",
        "ttft_ms": 1.0,
        "decode_tok_per_s": 1890.0,
        "mean_accepted_length": 2.9,
        "tokens_equal_plain": True,
        "speedup_vs_plain": 2.1,
    },
]


def test_takeaway_names_the_best_method_and_why_one_loses() -> None:
    t = takeaway(STAGES)
    assert t["best"] == "mtp"
    assert t["methods"]["mtp"]["speedup_vs_plain"] == 2.1
    assert t["methods"]["ngram"]["speedup_vs_plain"] == 0.5
    why = t["methods"]["ngram"]["why_slower"]
    assert why.startswith("1.40 tokens per step, but a speculative step costs 2.8x a plain one")
    assert "why_slower" not in t["methods"]["mtp"]


def test_every_losing_method_says_why_and_plain_wins() -> None:
    stages = [dict(s) for s in STAGES]
    stages[3]["speedup_vs_plain"] = 0.5  # MTP loses too (1.71 per step measured at load 11)
    t = takeaway(stages)
    assert "costs 5.8x a plain one" in t["methods"]["mtp"]["why_slower"]
    import io

    out = io.StringIO()
    from specport.samples.demo import _print_takeaway

    _print_takeaway(t, out.write)
    assert "plain decoding is the fastest" in out.getvalue()


def test_takeaway_without_speculation_stages_is_empty() -> None:
    assert takeaway(STAGES[:1]) == {"methods": {}, "best": None}


def test_report_ends_with_takeaway_and_next_commands(capsys) -> None:
    out = Path("demo-out")
    report = {
        "model_dir": "m",
        "model_seconds": 1.0,
        "export_seconds": 2.0,
        "passes": ["normalize"],
        "verify_max_abs_logits": 1e-5,
        "stages": STAGES,
        "artifact": str(out / "fp32"),
        "takeaway": takeaway(STAGES),
        "next": next_commands(out),
    }
    print_report(report)
    text = capsys.readouterr().out
    tail = text[text.index("takeaway") :]
    lines = tail.splitlines()
    assert "MTP" in lines[1] and "2.10x" in lines[1] and "same tokens" in lines[1]
    assert "n-gram" in lines[2] and "0.50x" in lines[2] and "fixed cost" in lines[2]
    assert "next, try:" in tail
    assert f"specport generate {out / 'fp32'}" in tail and "--speculative ngram" in tail


def test_next_commands_use_the_mtp_artifact_when_it_exists(tmp_path: Path) -> None:
    (tmp_path / "mtp").mkdir()
    (tmp_path / "mtp" / "specport.json").write_text("{}")
    assert "--speculative mtp" in next_commands(tmp_path)[0]


def test_next_commands_parse() -> None:
    import shlex

    from specport.cli import build_parser

    parser = build_parser()
    for command in next_commands(Path("demo-out")):
        argv = shlex.split(command)
        assert argv[0] == "specport"
        parser.parse_args(argv[1:])  # exits (fails the test) on a bad flag
