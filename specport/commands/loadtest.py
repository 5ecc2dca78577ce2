"""`specport loadtest URL --model NAME`: load and fault test of any OpenAI-compatible server.

The model is vLLM's `vllm bench serve`: seeded prompts, streamed greedy requests at each
concurrency level, requests/s, output tokens/s, TTFT and inter-token latency percentiles; here
every answer is also checked against its prompt's answer alone (no lost, truncated or mixed-up
responses). `--peer llama.cpp` starts `specport serve` and llama-cpp-python's server itself and
runs the same load on both.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from typing import Any

from specport.cli import emit_json
from specport.commands._args import POSITIVE
from specport.core.errors import UsageError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "loadtest",
        help="load and fault test of an OpenAI-compatible server (specport serve or any other)",
        description=(__doc__ or "").split("\n\n")[1].replace("\n", " "),
    )
    p.add_argument("url", nargs="?", help="the server's base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", help="the model name the server expects (its /v1/models id)")
    p.add_argument(
        "--concurrency",
        default="1,4,16,64",
        help="comma-separated concurrency levels (default 1,4,16,64)",
    )
    p.add_argument(
        "--requests", type=POSITIVE, default=64, help="requests per concurrency level (default 64)"
    )
    p.add_argument(
        "--max-tokens", type=POSITIVE, default=64, help="new tokens per request (default 64)"
    )
    p.add_argument("--api-key", default="unused", help="Bearer token, if the server wants one")
    p.add_argument(
        "--faults",
        action="store_true",
        help="then send what misbehaving clients send (a stream dropped halfway, a truncated, an "
        "oversized body, garbage bytes, an idle connection) and check the server still answers",
    )
    peer = p.add_argument_group("side by side with another server (starts both servers itself)")
    peer.add_argument(
        "--peer",
        choices=["llama.cpp"],
        help="start `specport serve --artifact` and llama-cpp-python's server on --gguf and run "
        "the same load on both, alternating which goes first (pip install 'specport[llamacpp]')",
    )
    peer.add_argument("--artifact", help="--peer: the specport artifact to serve")
    peer.add_argument("--gguf", help="--peer: the GGUF file llama.cpp serves")
    peer.add_argument(
        "--threads", type=POSITIVE, default=2, help="--peer: threads for each server (default 2)"
    )
    peer.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="--peer: extra `specport serve` flag (repeatable), e.g. --serve-arg=--max-batch=16",
    )
    work = p.add_argument_group(
        "open-loop workload (--rate): requests sent at their arrival times, latency and goodput"
    )
    work.add_argument(
        "--rate",
        help="comma-separated request rates per second to sweep, 'inf' = all at once (e.g. "
        "1,2,4,inf); replaces --concurrency; answers are timed, not checked",
    )
    work.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="arrival gaps: 1 = Poisson (default); below 1 burstier (gamma, as vllm bench serve)",
    )
    work.add_argument(
        "--prompt-len",
        default="100:1000",
        metavar="N|LO:HI",
        help="prompt length in words (~tokens), drawn uniformly (default 100:1000)",
    )
    work.add_argument(
        "--answer-len",
        default="128:512",
        metavar="N|LO:HI",
        help="new tokens per request, drawn uniformly (default 128:512; ignore_eos is sent)",
    )
    work.add_argument(
        "--prompts",
        metavar="FILE",
        help='prompts from FILE instead: one per line, or .jsonl with {"prompt", "max_tokens"}',
    )
    work.add_argument(
        "--shared-prefix",
        type=float,
        default=0.0,
        metavar="SHARE",
        help="share of the shortest prompt that every prompt starts with (0..1, default 0)",
    )
    work.add_argument(
        "--max-concurrency", type=POSITIVE, default=None, help="requests in flight at most"
    )
    work.add_argument(
        "--slo-ttft-ms",
        type=float,
        default=2000.0,
        help="goodput objective: time to first token at most this (default 2000)",
    )
    work.add_argument(
        "--slo-tpot-ms",
        type=float,
        default=None,
        help="goodput objective: time per output token at most this (default: none)",
    )
    work.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    p.add_argument("--out", help="also write the table (markdown) to this new file")
    p.add_argument(
        "--plot",
        metavar="FILE",
        help="draw output tokens/s and TTFT p50/p99 against concurrency into FILE (.png or .svg)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(run=run)


def _levels(text: str) -> list[int]:
    try:
        levels = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise UsageError(
            f"--concurrency takes positive integers separated by commas, got {text!r}."
        )
    return levels


def _rates(text: str) -> list[float | None]:
    try:
        rates = [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        rates = []
    if not rates or not all(r > 0 for r in rates):
        raise UsageError(f"--rate takes rates > 0 (or inf) separated by commas, got {text!r}.")
    return [None if r == float("inf") else r for r in rates]


def _check(args: argparse.Namespace) -> None:
    if args.rate and (args.peer or args.faults or args.plot):
        raise UsageError("--rate runs against a URL, without --peer, --faults or --plot.")
    if args.peer:
        if not (args.artifact and args.gguf) or args.url:
            raise UsageError("--peer needs --artifact and --gguf, and no URL.")
        if args.faults:
            raise UsageError("--faults runs against a URL; drop --peer or --faults.")
    else:
        if not (args.url and args.model):
            raise UsageError("give the server's URL and --model (or --peer llama.cpp).")
        if args.artifact or args.gguf or args.serve_arg:
            raise UsageError("--artifact, --gguf and --serve-arg go with --peer llama.cpp.")
    if args.out and os.path.exists(args.out):
        raise UsageError(f"--out {args.out} exists; give a new file name.")


def run(args: argparse.Namespace) -> int:
    from specport.bench import loadtest

    levels = _levels(args.concurrency)
    _check(args)
    if args.rate:
        return _run_rates(args)
    plot = None
    if args.plot:
        from specport.bench.plot import check_plot_path

        plot = check_plot_path(args.plot)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    report: dict[str, Any]
    if args.peer:
        from specport.bench.loadpeer import side_by_side

        report = side_by_side(
            args.artifact, args.gguf, levels, args.requests, args.max_tokens, args.threads,
            args.serve_arg,
        )  # fmt: skip
        text = report["title"] + "\n\n" + loadtest.table(report["rows"], server=True)
    else:
        rows = asyncio.run(
            loadtest.run_load(
                args.url, args.model, levels, args.requests, args.max_tokens, args.api_key
            )
        )
        load = os.getloadavg()
        report = {
            "title": f"{args.url} model {args.model}; {args.requests} requests per level, "
            f"max_tokens {args.max_tokens}, greedy, streamed; load average after the run "
            f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}",
            "rows": rows,
        }
        text = report["title"] + "\n\n" + loadtest.table(rows)
        if args.faults:
            report["faults"] = _faults(args)
            text += "\n" + "\n".join(f"fault {k}: {v}" for k, v in report["faults"].items())
    if args.out:
        with open(args.out, "x", encoding="utf-8") as f:  # never overwrite a user's file
            f.write(text + "\n")
    if plot is not None:
        from specport.bench.plot import load_chart, load_points

        title = (
            f"{args.requests} requests per level, {args.max_tokens} new tokens, greedy, "
            f"streamed; load average {os.getloadavg()[0]:.1f}"
        )
        report["plot"] = str(
            load_chart(load_points(report["rows"], args.model or "specport"), plot, title)
        )
    if args.json:
        emit_json(report)
    else:
        print(text)
        if plot is not None:
            print(f"chart: {plot}")
    return 0


def _run_rates(args: argparse.Namespace) -> int:
    from specport.bench import workload

    rates = _rates(args.rate)
    plan = workload.Plan(
        args.requests,
        workload.length_range(args.prompt_len, "--prompt-len"),
        workload.length_range(args.answer_len, "--answer-len"),
        args.shared_prefix,
        args.burstiness,
        args.prompts,
        args.seed,
    )

    def make(rate: float | None) -> list[Any]:
        return workload.build(
            plan.requests, rate, plan.prompt_len, plan.answer_len,
            shared_prefix=plan.shared_prefix, burstiness=plan.burstiness,
            prompts_file=plan.prompts_file, seed=plan.seed,
        )  # fmt: skip

    make(rates[0])  # a bad --prompts file or share is an error before any request
    logging.getLogger("httpx").setLevel(logging.WARNING)
    rows = asyncio.run(
        workload.sweep(
            args.url, args.model, args.api_key, rates, make, args.max_concurrency,
            args.slo_ttft_ms, args.slo_tpot_ms,
        )
    )  # fmt: skip
    load = os.getloadavg()
    slo = f"TTFT <= {args.slo_ttft_ms:g} ms" + (
        f", TPOT <= {args.slo_tpot_ms:g} ms" if args.slo_tpot_ms else ""
    )
    title = (
        f"{args.url} model {args.model}; {plan.title()}; goodput objective {slo}; load "
        f"average after the run {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    )
    text = title + "\n\n" + workload.table(rows)
    if args.out:
        with open(args.out, "x", encoding="utf-8") as f:  # never overwrite a user's file
            f.write(text + "\n")
    if args.json:
        emit_json({"title": title, "rows": rows})
    else:
        print(text)
    return 0


def _faults(args: argparse.Namespace) -> dict[str, str]:
    from specport.bench.loadtest import faults, run_load

    def clean(rows: list[dict[str, Any]]) -> bool:
        return rows[0]["errors"] == 0 and rows[0]["mismatches"] == 0

    ref = asyncio.run(run_load(args.url, args.model, [1], 2, 8, args.api_key))

    def check() -> bool:
        return clean(ref) and clean(
            asyncio.run(run_load(args.url, args.model, [2], 2, 8, args.api_key))
        )

    return faults(args.url, args.model, args.api_key, check)
