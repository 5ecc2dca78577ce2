"""The tables of ``benchmarks/serve_peers.sh``'s output folder (not a test).

    python -m benchmarks.serve_peers_report OUT

One table per workload (``prompts``, the 16 chat prompts, or a generated one such as ``chat`` or
``long``), one row per server, round and setting (concurrency or rate): completed/sent,
requests/s, output tokens/s, the server's mean prompt tokens, TTFT and TPOT p50/p99, goodput
(requests/s that met the TTFT objective, and their share), errors, and from ``log.txt`` the
1-minute load average before and after, the server's CPU seconds per output token (its child
processes included) and its largest resident memory; then the long-prompt stall per server and
round.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

_PART = re.compile(r"^-- (\S+) (.+?); uptime (before|after): .*load average: ([\d.]+)")
_CPU = re.compile(r"^-- (\S+) (.+?); uptime after: .*server cpu s: ([\d.]+)")
_RSS = re.compile(r"server rss max MB: (\d+)")
_FILE = re.compile(r"(.+)-r(\d+)-(?:(.+)-)?(c\d+|rates|stall)\.json")


def _last_json(path: Path) -> Any:
    lines = [x for x in path.read_text().splitlines() if x.startswith("{")]
    return json.loads(lines[-1]) if lines else None  # None: a part still running, or failed


def _log(out: Path) -> dict[tuple[str, str, int], dict[str, Any]]:
    """(server, part, occurrence) -> load before/after and server CPU seconds."""
    seen: dict[tuple[str, str], int] = {}
    parts: dict[tuple[str, str, int], dict[str, Any]] = {}
    for line in (out / "log.txt").read_text().splitlines():
        m = _PART.match(line)
        if not m:
            continue
        server, name, when, load = m.groups()
        if when == "before":
            seen[(server, name)] = seen.get((server, name), 0) + 1
        key = (server, name, seen.get((server, name), 1))
        parts.setdefault(key, {})[when] = float(load)
        c = _CPU.match(line)
        if c:
            parts[key]["cpu_s"] = float(c.group(3))
        r = _RSS.search(line)
        if r:
            parts[key]["rss_mb"] = int(r.group(1))
    return parts


_HEAD = (
    "| server | round | setting | done/sent | req/s | output tok/s | prompt tok | "
    "TTFT p50 / p99 ms | TPOT p50 / p99 ms | goodput req/s (met) | errors | "
    "load before / after | server CPU ms / output token | server RSS max MB |\n"
    "|---|---:|---|---|---:|---:|---:|---:|---:|---|---|---|---:|---:|"
)


def _row(server: str, rnd: str, setting: str, row: dict[str, Any], info: dict[str, Any]) -> str:
    tokens = row["output_tokens_per_s"] * row["wall_s"]
    cpu = info.get("cpu_s")
    per_token = f"{1e3 * cpu / tokens:.1f}" if cpu and tokens else "-"
    ttft, tpot = row["ttft_ms"], row["tpot_ms"]
    errors = ", ".join(f"{k}: {v}" for k, v in (row["errors"] or {}).items()) or "0"
    return (
        f"| {server} | {rnd} | {setting} | {row['completed']}/{row['requests']} | "
        f"{row['requests_per_s']} | {row['output_tokens_per_s']} | {row['mean_prompt_tokens']} | "
        f"{ttft[0]} / {ttft[2]} | {tpot[0]} / {tpot[2]} | "
        f"{row.get('goodput_requests_per_s', '-')} ({row.get('slo_met', '-')}) | {errors} | "
        f"{info.get('before', '-')} / {info.get('after', '-')} | {per_token} | "
        f"{info.get('rss_mb', '-')} |"
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("out", type=Path)
    out = ap.parse_args(argv).out
    log = _log(out)
    tables: dict[str, list[str]] = {}
    stalls = []
    for path in sorted(out.glob("*-r*-*.json"), key=lambda p: p.stat().st_mtime):
        m = _FILE.fullmatch(path.name)
        if not m:
            continue
        server, rnd, workload, what = m.groups()
        data = _last_json(path)
        if data is None:
            continue
        if what == "stall":
            stalls.append((server, rnd, data["summary"], data["load_average"]))
            continue
        prefix = f"{workload}-" if workload else ""
        if what == "rates":
            name = next(
                (n for (s, n, _) in log if s == server and n.startswith(f"{prefix}rates")),
                "",
            )
        else:
            name = f"{prefix}c={what[1:]}"
        info = log.get((server, name, int(rnd)), {})
        rows = tables.setdefault(workload or "prompts", [])
        for row in data["rows"]:
            if what == "rates":  # one part for the whole sweep: no per-rate CPU figure
                setting = f"rate {row['rate']}/s"
                rows.append(_row(server, rnd, setting, row, {**info, "cpu_s": None}))
            else:
                rows.append(_row(server, rnd, f"c={what[1:]}", row, info))
    for workload, rows in tables.items():
        print(f"### {workload}\n\n{_HEAD}")
        print("\n".join(rows))
        print()
    print("| server | round | usual gap ms | median gap during the prefill ms | worst gap ms | "
          "worst / usual | TTFT of the long prompt s | load average |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for server, rnd, s, load in stalls:
        print(
            f"| {server} | {rnd} | {s['usual_gap_ms']} | {s['gap_during_ms']} | "
            f"{s['worst_gap_ms']} | {s['ratio']} | {s['ttft_s']} | "
            f"{' '.join(f'{x:.1f}' for x in load)} |"
        )


if __name__ == "__main__":
    main()
