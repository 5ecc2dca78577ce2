"""The tables of ``benchmarks/serve_peers.sh``'s output folder (not a test).

    python -m benchmarks.serve_peers_report OUT

One row per server, round and setting (concurrency or rate): completed/sent, requests/s, output
tokens/s, the server's mean prompt tokens, TTFT and TPOT p50/p99, errors, and from ``log.txt`` the
1-minute load average before and after and the server's CPU seconds per output token; then the
long-prompt stall per server and round.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

_PART = re.compile(r"^-- (\S+) (.+?); uptime (before|after): .*load average: ([\d.]+)")
_CPU = re.compile(r"^-- (\S+) (.+?); uptime after: .*server cpu s: ([\d.]+)")


def _last_json(path: Path) -> Any:
    lines = [x for x in path.read_text().splitlines() if x.startswith("{")]
    return json.loads(lines[-1])


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
    return parts


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("out", type=Path)
    out = ap.parse_args(argv).out
    log = _log(out)
    print("| server | round | setting | done/sent | req/s | output tok/s | prompt tok | "
          "TTFT p50 / p99 ms | TPOT p50 / p99 ms | errors | load before / after | "
          "server CPU ms / output token |")  # fmt: skip
    print("|---|---:|---|---|---:|---:|---:|---:|---:|---|---|---:|")
    stalls = []
    for path in sorted(out.glob("*-r*-*.json"), key=lambda p: p.stat().st_mtime):
        server, rnd, what = re.match(r"(.+)-r(\d+)-(.+)\.json", path.name).groups()  # type: ignore[union-attr]
        data = _last_json(path)
        if what == "stall":
            stalls.append((server, rnd, data["summary"], data["load_average"]))
            continue
        part = f"c={what[1:]}" if what.startswith("c") else f"rates {what}"
        name = (
            part
            if what.startswith("c")
            else next((n for (s, n, _) in log if s == server and n.startswith("rates")), part)
        )
        info = log.get((server, name, int(rnd)), {})
        for row in data["rows"]:
            tokens = row["output_tokens_per_s"] * row["wall_s"]
            cpu = info.get("cpu_s")
            per_token = (
                f"{1e3 * cpu / tokens:.1f}" if cpu and tokens and what.startswith("c") else "-"
            )
            setting = part if what.startswith("c") else f"rate {row['rate']}/s"
            ttft, tpot = row["ttft_ms"], row["tpot_ms"]
            print(
                f"| {server} | {rnd} | {setting} | {row['completed']}/{row['requests']} | "
                f"{row['requests_per_s']} | {row['output_tokens_per_s']} | "
                f"{row['mean_prompt_tokens']} | {ttft[0]} / {ttft[2]} | {tpot[0]} / {tpot[2]} | "
                f"{row['errors'] or 0} | {info.get('before', '-')} / {info.get('after', '-')} | "
                f"{per_token} |"
            )
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
