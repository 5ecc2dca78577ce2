"""Helper of benchmarks/serve_vs_vllm.sh: the load on one server, the HF folder vLLM needs, the table.

    python -m benchmarks.serve_vs_vllm hf-dir ART OUT_DIR
    python -m benchmarks.serve_vs_vllm load URL --model NAME --server specport --round 1 \
        --concurrency 16,64 --requests 64 --max-tokens 64 --out round1-specport.json
    python -m benchmarks.serve_vs_vllm report OUT_DIR

`load` is `specport loadtest`'s own measurement (its seeded prompts, references one request at a
time, then each concurrency level through the official OpenAI client, streamed, temperature 0),
run in-process so that each request's result is also kept: vLLM's `bench serve` reports the time
per output token (TPOT: a request's time after its first token over its other tokens), which the
load test's row does not carry (its ITL is the gap between streamed chunks). The JSON keeps the
references too, so `report` can say whether two servers gave the same answers.

`hf-dir` writes the Hugging Face folder of the artifact's source (a GGUF source goes through
specport's own GGUF import, the same dequantized fp32 weights the artifact was exported from, and
the artifact's own tokenizer files are copied in), so vLLM serves the same weights and tokenizer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from specport.bench import loadtest

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def hf_dir(artifact: Path, out: Path) -> Path:
    """The HF folder for `artifact`'s source in `out` (made once; an HF source is used as is)."""
    manifest = json.loads((artifact / "specport.json").read_text())
    source = manifest.get("source") or {}
    if source.get("kind") != "gguf":
        path = Path(source.get("path", ""))
        if not (path / "config.json").exists():
            raise SystemExit(f"{artifact}'s source {path} is not an HF folder on this machine")
        return path
    stamp = out / ".source_sha256"
    sha = source["gguf"]["sha256"]
    if stamp.exists() and stamp.read_text() == sha:
        return out
    from specport.exporter.gguf_import import save_gguf_as_hf

    out.mkdir(parents=True, exist_ok=True)
    save_gguf_as_hf(Path(source["path"]), out, progress=False)
    for name in TOKENIZER_FILES:  # the artifact's tokenizer, byte for byte
        if (artifact / name).exists():
            shutil.copy2(artifact / name, out / name)
    stamp.write_text(sha)
    return out


def _la() -> list[float]:
    """The 1, 5 and 15 minute load averages."""
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def tpot_ms(results: list[loadtest.Result]) -> list[float]:
    """Per request, (last token time - first token time) / (tokens - 1), in ms."""
    out = []
    for r in results:
        if r.error is None and r.tokens > 1 and r.gaps:
            out.append(sum(r.gaps) / (r.tokens - 1) * 1e3)
    return out


async def measure(
    url: str, model: str, levels: list[int], requests: int, max_tokens: int
) -> dict[str, Any]:
    """References, then each level; each row is the load test's row plus TPOT p50/p90/p99."""
    seen: list[loadtest.Result] = []
    plain = loadtest.one

    async def recording(*args: Any, **kwargs: Any) -> loadtest.Result:
        r = await plain(*args, **kwargs)
        seen.append(r)
        return r

    client = loadtest.client_for(url, "unused")
    texts = loadtest.prompts(requests)
    t0 = time.perf_counter()
    refs = await loadtest.references(client, model, texts, max_tokens)
    ref_s = time.perf_counter() - t0
    rows = []
    loadtest.one = recording  # type: ignore[assignment]  # level() calls the module's `one`
    try:
        for c in levels:
            seen.clear()
            t0 = time.perf_counter()
            row = await loadtest.level(client, model, texts, refs, c, max_tokens)
            tp = tpot_ms(seen)
            row["tpot_ms"] = [
                round(float(np.percentile(tp, q)), 2) if tp else None for q in (50, 90, 99)
            ]
            row["wall_s"] = round(time.perf_counter() - t0, 1)
            rows.append(row)
    finally:
        loadtest.one = plain  # type: ignore[assignment]
    await client.close()
    return {"references": refs, "references_s": round(ref_s, 1), "rows": rows}


def load(args: argparse.Namespace) -> None:
    out = Path(args.out)
    if out.exists():
        raise SystemExit(f"{out} exists; give a new file name")
    levels = [int(x) for x in args.concurrency.split(",")]
    before = _la()
    t0 = time.perf_counter()
    result = asyncio.run(measure(args.url, args.model, levels, args.requests, args.max_tokens))
    report = {
        "server": args.server,
        "round": args.round,
        "url": args.url,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "load_before": before,
        "load_after": _la(),
        "wall_s": round(time.perf_counter() - t0, 1),
        **result,
    }
    out.write_text(json.dumps(report, indent=1))
    for r in result["rows"]:
        print(
            f"{args.server} round {args.round} c={r['concurrency']}: {r['output_tokens_per_s']} tok/s, "
            f"TTFT p50 {r['ttft_ms'][0]} p99 {r['ttft_ms'][2]} ms, TPOT p50 {r['tpot_ms'][0]} ms, "
            f"errors {r['errors']}, mismatches {r['mismatches']}"
        )


def _same_answers(a: dict[str, str], b: dict[str, str]) -> str:
    common = [p for p in a if p in b]
    return f"{sum(a[p] == b[p] for p in common)}/{len(common)}"


def report(args: argparse.Namespace) -> None:
    folder = Path(args.dir)
    runs = [json.loads(p.read_text()) for p in sorted(folder.glob("round*-*.json"))]
    if not runs:
        raise SystemExit(f"no round*-*.json in {folder}")
    servers = list(dict.fromkeys(r["server"] for r in runs))
    lines = [
        "| round | server | concurrency | output tok/s | TTFT p50 / p99 ms | TPOT p50 ms "
        "| errors | mismatches | reconnects | load before → after |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        la = f"{r['load_before'][0]} → {r['load_after'][0]}"
        for row in r["rows"]:
            lines.append(
                f"| {r['round']} | {r['server']} | {row['concurrency']} | "
                f"{row['output_tokens_per_s']} | {row['ttft_ms'][0]} / {row['ttft_ms'][2]} | "
                f"{row['tpot_ms'][0]} | {row['errors']} | {row['mismatches']} | "
                f"{row.get('reconnects', 0)} | {la} |"
            )
    summary: list[dict[str, Any]] = []
    lines += ["", "Median over rounds:", ""]
    lines += [
        "| server | concurrency | rounds | output tok/s | TTFT p50 / p99 ms | TPOT p50 ms | errors |",
        "|---|---|---|---|---|---|---|",
    ]
    levels = sorted({row["concurrency"] for r in runs for row in r["rows"]})
    for c in levels:
        for s in servers:
            rows = [
                row
                for r in runs
                if r["server"] == s
                for row in r["rows"]
                if row["concurrency"] == c
            ]
            if not rows:
                continue
            med = {
                "server": s,
                "concurrency": c,
                "rounds": len(rows),
                "output_tokens_per_s": round(
                    statistics.median(x["output_tokens_per_s"] for x in rows), 1
                ),
                "ttft_p50_ms": round(statistics.median(x["ttft_ms"][0] for x in rows), 1),
                "ttft_p99_ms": round(statistics.median(x["ttft_ms"][2] for x in rows), 1),
                "tpot_p50_ms": round(statistics.median(x["tpot_ms"][0] or 0.0 for x in rows), 2),
                "errors": sum(x["errors"] for x in rows),
            }
            summary.append(med)
            lines.append(
                f"| {s} | {c} | {med['rounds']} | {med['output_tokens_per_s']} | "
                f"{med['ttft_p50_ms']} / {med['ttft_p99_ms']} | {med['tpot_p50_ms']} | {med['errors']} |"
            )
    first = {s: next(r for r in runs if r["server"] == s)["references"] for s in servers}
    lines.append("")
    for s in servers[1:]:
        lines.append(
            f"Greedy answers (one request at a time) equal to {servers[0]}'s: "
            f"{s} {_same_answers(first[servers[0]], first[s])}."
        )
    (folder / "summary.md").write_text("\n".join(lines) + "\n")
    (folder / "summary.json").write_text(json.dumps({"median": summary, "runs": runs}, indent=1))
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    h = sub.add_parser("hf-dir", help="print the HF folder vLLM serves for ART (made if needed)")
    h.add_argument("artifact")
    h.add_argument("out")
    ld = sub.add_parser("load", help="the load test on one server, into a new JSON file")
    ld.add_argument("url")
    ld.add_argument("--model", required=True)
    ld.add_argument("--server", required=True, help="a name for the table (specport, vllm, ...)")
    ld.add_argument("--round", type=int, required=True)
    ld.add_argument("--concurrency", default="16,64")
    ld.add_argument("--requests", type=int, default=64)
    ld.add_argument("--max-tokens", type=int, default=64)
    ld.add_argument("--out", required=True)
    rp = sub.add_parser("report", help="summary.md and summary.json from a run's folder")
    rp.add_argument("dir")
    args = p.parse_args(argv)
    if args.cmd == "hf-dir":
        print(hf_dir(Path(args.artifact), Path(args.out)))
    elif args.cmd == "load":
        load(args)
    else:
        report(args)


if __name__ == "__main__":
    main()
