"""Charts of what `specport bench`, `specport loadtest` and `specport eval compare` print.

Each chart draws the numbers of the table its command prints, nothing else, so a chart in the
docs can be checked against the table beside it:

- `bench_chart`: decode tok/s per engine (and per batch size), or per speculative method with
  its speedup over plain decoding written on the bar;
- `load_chart`: output tokens/s and TTFT p50 / p99 against concurrency, one line per server or
  engine (`specport loadtest`, `specport bench --requests N [N ...]`);
- `quality_chart`: perplexity against bits per weight for quantization schemes
  (`specport eval compare A B [C ...]`).

matplotlib is an optional dependency (`pip install 'specport[plot]'`); `check_plot_path` says so
before any long work starts. Files are PNG or SVG, chosen by the suffix; an SVG carries no
date, so the same numbers make the same file.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specport.core.errors import UsageError

SUFFIXES = (".png", ".svg")


def check_plot_path(path: str | os.PathLike[str], flag: str = "--plot") -> Path:
    """The chart's path, checked before the measurement: a .png or .svg file that does not exist
    yet in a directory that does, and matplotlib installed."""
    out = Path(path)
    if out.suffix.lower() not in SUFFIXES:
        raise UsageError(f"{flag} {out}: give a .png or .svg file name.")
    if out.exists():
        raise UsageError(f"{flag} {out} exists; give a new file name (specport never replaces it).")
    if not out.parent.is_dir():
        raise UsageError(f"{flag} {out}: the directory {out.parent} does not exist.")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError(
            f"{flag} needs matplotlib: pip install 'specport[plot]' (or pip install matplotlib)."
        ) from None
    return out


def _figure(columns: int = 1) -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    plt.rcParams.update({"svg.hashsalt": "specport", "svg.fonttype": "none", "font.size": 9})
    fig, axes = plt.subplots(1, columns, figsize=(4.2 * columns + 0.8, 3.4), squeeze=False)
    return fig, axes[0]


def _save(fig: Any, path: Path, title: str) -> Path:
    import matplotlib.pyplot as plt

    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    metadata = {"Date": None} if path.suffix.lower() == ".svg" else {}
    with open(path, "xb") as f:  # never replace a file that appeared meanwhile
        fig.savefig(f, format=path.suffix.lower()[1:], dpi=110, metadata=metadata)
    plt.close(fig)
    return path


def _bars(ax: Any, labels: Sequence[str], values: Sequence[float], notes: Sequence[str]) -> None:
    positions = range(len(labels))
    bars = ax.bar(positions, values, color=[_color(i) for i in positions])
    for bar, note in zip(bars, notes):
        if note:
            ax.annotate(
                note,
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=8,
            )
    ax.set_xticks(list(positions), labels, rotation=20, ha="right")
    ax.margins(y=0.15)


def _color(i: int) -> str:
    return f"C{i % 10}"


def bench_chart(reports: Sequence[dict[str, Any]], path: Path) -> Path:
    """`specport bench`'s plain reports (one per --batch) or one --speculative report."""
    if "rows" in reports[0]:  # --speculative / --tree-width / --ceiling
        report = reports[0]
        rows = report["rows"]
        fig, (ax,) = _figure()
        _bars(
            ax,
            [r["engine"] for r in rows],
            [r["decode_tok_per_s"] or 0.0 for r in rows],
            [f"{r['speedup_vs_plain']:.2f}x" if r.get("speedup_vs_plain") else "" for r in rows],
        )
        ax.set_ylabel("decode tokens/s (batch 1, median)")
        title = (
            f"{report['prompts']} prompts, {report['max_new_tokens']} new tokens, "
            f"K={report['num_draft']}; bar label: speed vs plain"
        )
        return _save(fig, path, title)
    fig, (ax,) = _figure()
    engines = list(reports[0]["engines"])
    width = 0.8 / len(reports)
    for j, report in enumerate(reports):
        values = [report["engines"][e].get("decode_tok_per_s") or 0.0 for e in engines]
        xs = [i + (j - (len(reports) - 1) / 2) * width for i in range(len(engines))]
        bars = ax.bar(xs, values, width, label=f"batch {report['config']['batch']}")
        for bar, value in zip(bars, values):
            ax.annotate(
                f"{value:.0f}",
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=8,
            )
    ax.set_xticks(range(len(engines)), engines, rotation=20, ha="right")
    ax.set_ylabel("decode tokens/s (median)")
    ax.margins(y=0.15)
    if len(reports) > 1:
        ax.legend()
    cfg = reports[0]["config"]
    title = (
        f"prompt {cfg['prompt_len']}, {cfg['new_tokens']} new tokens, {cfg['runs']} runs, "
        f"load average {reports[0]['hardware'].get('load_average')}"
    )
    return _save(fig, path, title)


def load_chart(series: dict[str, list[dict[str, Any]]], path: Path, title: str) -> Path:
    """Tokens/s and TTFT p50 / p99 against concurrency; `series` maps a server (or engine) name
    to its points: dicts with `concurrency`, `output_tok_per_s`, `ttft_ms_p50`, `ttft_ms_p99`."""
    fig, (left, right) = _figure(columns=2)
    for i, (name, points) in enumerate(series.items()):
        points = sorted(points, key=lambda p: p["concurrency"])
        xs = [p["concurrency"] for p in points]
        left.plot(xs, [p["output_tok_per_s"] for p in points], "o-", color=_color(i), label=name)
        right.plot(
            xs, [p["ttft_ms_p50"] for p in points], "o-", color=_color(i), label=f"{name} p50"
        )
        right.plot(
            xs, [p["ttft_ms_p99"] for p in points], "s--", color=_color(i), label=f"{name} p99"
        )
    levels = sorted({p["concurrency"] for points in series.values() for p in points})
    for ax in (left, right):
        ax.set_xlabel("concurrent requests")
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
    left.set_ylim(bottom=0)
    left.set_ylabel("output tokens/s")
    right.set_ylabel("time to first token, ms")
    right.set_yscale("log")
    left.legend(fontsize=7)
    right.legend(fontsize=7)
    return _save(fig, path, title)


def quality_chart(points: Sequence[dict[str, Any]], path: Path, title: str) -> Path:
    """Perplexity against bits per weight; `points`: dicts with `label`, `bits`, `ppl`."""
    fig, (ax,) = _figure()
    for i, p in enumerate(points):
        ax.scatter([p["bits"]], [p["ppl"]], color=_color(i), zorder=3)
        ax.annotate(
            p["label"], (p["bits"], p["ppl"]), textcoords="offset points", xytext=(5, 4), fontsize=8
        )
    ax.set_xscale("log", base=2)
    ticks = sorted({p["bits"] for p in points})
    ax.set_xticks(ticks, [f"{b:g}" for b in ticks])
    ax.set_xlabel("bits per weight (MatMul weights)")
    ax.set_ylabel("perplexity (lower is better)")
    ax.grid(alpha=0.3)
    ax.margins(x=0.2, y=0.2)
    return _save(fig, path, title)


def load_points(
    rows: Sequence[dict[str, Any]], name: str = "server"
) -> dict[str, list[dict[str, Any]]]:
    """`specport loadtest` rows as `load_chart` series: one per `server` when the rows carry one
    (a side-by-side run), else one called `name`."""
    series: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        series.setdefault(r.get("server", name), []).append(
            {
                "concurrency": r["concurrency"],
                "output_tok_per_s": r["output_tokens_per_s"],
                "ttft_ms_p50": r["ttft_ms"][0],
                "ttft_ms_p99": r["ttft_ms"][2],
            }
        )
    return series
