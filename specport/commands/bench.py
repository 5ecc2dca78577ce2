"""`specport bench ARTIFACT`: TTFT, TPOT, throughput, overhead, memory, bandwidth floor, peers."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from typing import Any

from specport.cli import emit_json
from specport.commands._args import (
    NON_NEGATIVE,
    POSITIVE,
    add_runtime_options,
    add_suffix_corpus_option,
    int_at_least,
    int_between,
)
from specport.core.errors import SpecportError, UsageError
from specport.generation_args import METHODS
from specport.self_draft import ensure_self_draft, is_self


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="measure latency/throughput against the hardware and peers")
    p.add_argument("artifact")
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--prompt-ids", help="comma-separated prompt token ids (repeated per batch row)"
    )
    src.add_argument(
        "--prompt-len",
        type=int_at_least(2),
        default=32,
        help="random prompt of this many tokens (default 32)",
    )
    p.add_argument(
        "--new-tokens",
        type=int_at_least(2),
        default=128,
        help="tokens generated per run (EOS ignored)",
    )
    p.add_argument(
        "--batch", type=POSITIVE, nargs="+", default=[1], help="batch size(s), e.g. --batch 1 8"
    )
    p.add_argument(
        "--runs",
        type=POSITIVE,
        default=5,
        help="measured runs per engine (after one warm-up); medians",
    )
    p.add_argument(
        "--peer",
        action="append",
        default=[],
        metavar="PEER",
        help="also run this engine on the same prompts (repeatable): onnxruntime-genai, "
        "transformers, llama.cpp (the GGUF type matching the artifact's bit width) or "
        "llama.cpp:TYPE (e.g. llama.cpp:Q4_K_M), or specport:ARTIFACT (another artifact of "
        "the same model, e.g. its int8-KV quantization), openvino-genai (exact fp32; "
        "openvino-genai:default for OpenVINO's own precision; runs in its own venv, created "
        "on first use); with --speculative: onnxruntime-genai or llama.cpp[:TYPE], each "
        "optionally +ngram (its own n-gram speculation), e.g. llama.cpp+ngram, and "
        "openvino-genai[:default] optionally +lookup (its prompt lookup) or +draft (its "
        "draft-model speculation with --draft's model)",
    )
    p.add_argument(
        "--peer-gguf",
        metavar="FILE",
        help="GGUF of the same checkpoint for --peer llama.cpp (default: the artifact's source, "
        "when it was exported from a GGUF)",
    )
    add_runtime_options(p)
    p.set_defaults(provider="cpu")
    spin = p.add_mutually_exclusive_group()
    spin.add_argument(
        "--spin",
        dest="spin",
        action="store_true",
        default=None,
        help="let onnxruntime threads busy-wait (default: auto, only with an idle core)",
    )
    spin.add_argument("--no-spin", dest="spin", action="store_false")
    p.add_argument(
        "--seed",
        type=NON_NEGATIVE,
        default=0,
        help="seed of the random prompt, of the --request-rate arrivals and of --prompts-split",
    )
    spec = p.add_argument_group("speculative decoding (plain greedy vs each method, same prompts)")
    spec.add_argument(
        "--speculative",
        action="append",
        choices=list(METHODS),
        help="benchmark this method against plain greedy (repeatable)",
    )
    spec.add_argument(
        "--num-draft",
        type=int_between(1, 16),
        default=None,
        help="draft tokens per step (default: all MTP heads when mtp is benchmarked, else 4; "
        "auto: its own default, 16 for a prompt that copies well and 8 otherwise, as generate runs it)",
    )
    spec.add_argument(
        "--draft",
        help="draft artifact for --speculative draft, and auto's model drafter (e.g. the "
        "artifact quantized: `specport quantize A --scheme w4a8`), or self: the target's own "
        "4-bit file, made on first use and cached",
    )
    add_suffix_corpus_option(spec)
    spec.add_argument(
        "--adaptive",
        choices=["default", "on", "off", "both"],
        default="default",
        help="adaptive draft length (per-step K from recent acceptance); both = each method twice",
    )
    spec.add_argument(
        "--tree-width",
        type=int_between(1, 16),
        action="append",
        default=[],
        help="also run ngram / mtp / eagle (those given with --speculative; ngram when none) as a "
        "token tree of this many candidates (repeatable; 1 runs the tree loop on a chain; the "
        "artifact must be exported with --tree-mask)",
    )
    spec.add_argument(
        "--ceiling",
        action="store_true",
        help="also run drafts that are always right (plain greedy's own next tokens) at K = 1, "
        "2, 4 .. --num-draft: the most any proposer could gain per draft length on this machine",
    )
    spec.add_argument("--prompt", action="append", default=[], help="prompt text (repeatable)")
    spec.add_argument(
        "--prompt-set",
        help="built-in prompts when no --prompt: story (default) | copy | chat (16 chat "
        "prompts, chat template) | chat-question | chat-instruction | chat-rewrite | chat-more "
        "(16 other chat prompts, to check a drafter tuned on chat); with "
        "--requests: the requests' prompts (default: random ids said twice)",
    )
    files = p.add_argument_group(
        "prompt files (with --speculative: per-category rows; see docs/guides/benchmarking.md)"
    )
    files.add_argument(
        "--prompts",
        metavar="FILE",
        help="decode the prompts of FILE: JSONL/JSON records with turns (MT-bench, Spec-Bench; "
        "each later turn follows plain greedy's own answer to the one before), instruction "
        "[+ input] (Alpaca, self-instruct), messages (OpenAI chat) or prompt, or plain text "
        "(one prompt per blank-line separated paragraph); a record's category gets rows of "
        "its own",
    )
    files.add_argument(
        "--prompts-limit",
        type=POSITIVE,
        metavar="N",
        help="at most N records of each category (of the file when it has none), in file order",
    )
    files.add_argument(
        "--prompts-split",
        choices=["all", "tune", "eval"],
        default="all",
        help="all records (default), or one half of each category: a record's half follows "
        "from its text and --seed, so tuning on tune and measuring on eval keep them apart "
        "(train-draft --data-split takes the same halves)",
    )
    files.add_argument(
        "--prompts-category",
        action="append",
        default=[],
        metavar="NAME",
        help="only the records of this category (repeatable)",
    )
    load = p.add_argument_group(
        "serving load (the request engines of `specport serve`, shared-layout artifacts)"
    )
    load.add_argument(
        "--requests",
        type=POSITIVE,
        nargs="+",
        metavar="N",
        help="N concurrent requests: continuous batching vs one at a time, one request alone vs "
        "Model.generate, and the prefix cache on a shared system prompt (--runs rounds); "
        "several N (e.g. --requests 1 4 8) run one after another and --plot draws them against "
        "concurrency",
    )
    load.add_argument(
        "--request-rate",
        default=None,
        metavar="R",
        help="with --requests: requests arrive at R per second (Poisson arrivals from --seed, "
        "as vLLM's benchmark_serving sends them; the same schedule for every engine and round), "
        "and each request's TTFT, TPOT and end-to-end latency count from its own arrival "
        "(default: all at once; inf: all at once)",
    )
    load.add_argument(
        "--prefix-tokens",
        type=POSITIVE,
        default=384,
        help="shared system prompt length (default 384)",
    )
    load.add_argument(
        "--spec-max-rows",
        type=NON_NEGATIVE,
        default=None,
        help="with --requests and --speculative: rows verify one by one while at most this "
        "many decode (default: the engine's, 1)",
    )
    load.add_argument(
        "--spec-max-tokens",
        type=NON_NEGATIVE,
        default=None,
        help="with --requests and --speculative: above --spec-max-rows, rows verify together "
        "in one run at the width the measured step cost favours, rows x (1 + drafts) at most "
        "this (default: the engine's, 24)",
    )
    p.add_argument(
        "--plot",
        metavar="FILE",
        help="also draw the table into FILE (.png or .svg): decode tok/s per engine (per batch "
        "size), per speculative method, or with --requests tokens/s and TTFT p50/p99 against "
        "the number of concurrent requests",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from specport.bench.artifact import run_bench
    from specport.bench.report import format_table
    from specport.bench.results import BenchConfig
    from specport.commands.generate import parse_ids

    if args.plot:  # before the measurement: a bad name must not cost a run
        from specport.bench.plot import check_plot_path

        args.plot = check_plot_path(args.plot)
    if args.suffix_corpus and not {"suffix", "auto"} & set(args.speculative or []):
        raise UsageError(
            "--suffix-corpus is read only by --speculative suffix or auto; add one or drop it."
        )
    if args.request_rate is not None:  # checked here, not by argparse: one line, no usage
        args.request_rate = _request_rate(args.request_rate)
    _check_prompt_file_options(args)
    if args.requests is not None and args.ceiling:
        raise UsageError("--ceiling runs one prompt at a time; drop --requests or --ceiling.")
    if args.requests is not None:
        return _run_engines(args)
    if args.request_rate is not None:
        raise UsageError("--request-rate is how --requests N arrive; add --requests N.")
    if args.speculative or args.tree_width or args.ceiling:
        return _run_speculative(args)
    if args.prompt or args.prompt_set or args.prompts:
        given = "--prompt" if args.prompt else "--prompt-set" if args.prompt_set else "--prompts"
        raise UsageError(
            f"{given} picks the prompts of --speculative, --ceiling or --requests runs; plain "
            "decode benches a random prompt (--prompt-len N) or --prompt-ids. For chat prompts "
            "add --speculative ngram (its plain row is plain decoding)."
        )

    from specport.bench.peers import check_peer_name
    from specport.bench.spec_peers import SPEC_SUFFIXES

    for name in args.peer:
        if name.endswith(SPEC_SUFFIXES):
            suffix = "+" + name.rpartition("+")[2]
            raise UsageError(
                f"--peer {name}: {suffix} peers are the peer's own speculative "
                "decoding, measured beside specport's: add --speculative ngram|draft|mtp (or "
                f"drop {suffix} for a plain peer)."
            )
        try:
            check_peer_name(name)
        except SpecportError as e:  # an option value: a usage error
            raise UsageError(str(e)) from None
    ids = parse_ids(args.prompt_ids) if args.prompt_ids else None
    reports = []
    for batch in args.batch:
        config = BenchConfig(
            prompt_len=len(ids) if ids else args.prompt_len,
            new_tokens=args.new_tokens,
            batch=batch,
            runs=args.runs,
            threads=args.threads,
            allow_spinning=args.spin,
            provider=args.provider,
            prompt_ids=ids,
            seed=args.seed,
            peer_gguf=args.peer_gguf,
        )
        report = run_bench(args.artifact, config, peers=args.peer, progress=None)
        reports.append(report)
        if not args.json:
            print(format_table(report), flush=True)
            print(flush=True)
    if len(reports) > 1:
        base = reports[0]["engines"]["specport"]["decode_tok_per_s"]
        scaling = {
            r["config"]["batch"]: round(r["engines"]["specport"]["decode_tok_per_s"] / base, 2)
            for r in reports
            if base
        }
        if not args.json:
            print(
                f"decode throughput vs batch {reports[0]['config']['batch']}: {scaling}",
                file=sys.stdout,
            )
    if args.plot:
        from specport.bench.plot import bench_chart

        bench_chart(reports, args.plot)
        if not args.json:
            print(f"chart: {args.plot}")
    if args.json:
        emit_json(reports[0] if len(reports) == 1 else {"batches": reports})
    return 0


def _run_speculative(args: argparse.Namespace) -> int:
    from specport.bench.speculative import (
        SpecBenchConfig,
        format_speculative_table,
        run_speculative_bench,
    )
    from specport.commands.generate import parse_ids

    config = SpecBenchConfig(
        methods=list(dict.fromkeys(args.speculative or [])),
        num_draft=_num_draft(args),
        auto_num_draft=args.num_draft,  # not given: auto's own default, as generate runs it
        draft=_draft(args),
        prompts=args.prompt,
        prompt_ids=[parse_ids(args.prompt_ids)] if args.prompt_ids else [],
        prompt_set=args.prompt_set or "story",
        max_new_tokens=args.new_tokens,
        runs=args.runs,
        threads=args.threads,
        adaptive=args.adaptive,
        tree_widths=args.tree_width,
        ceiling=args.ceiling,
        suffix_corpus=args.suffix_corpus,
        peers=args.peer,
        peer_gguf=args.peer_gguf,
        allow_spinning=args.spin,
        prompt_file=_prompt_file(args),
    )
    report = run_speculative_bench(args.artifact, config)
    if args.plot:
        from specport.bench.plot import bench_chart

        bench_chart([report], args.plot)
    _emit(args, report, format_speculative_table)
    if args.plot and not args.json:
        print(f"chart: {args.plot}")
    return 0


def _check_prompt_file_options(args: argparse.Namespace) -> None:
    """--prompts excludes the other prompt sources; its selectors need it."""
    if args.prompts is None:
        picked = [
            name
            for name, given in (
                ("--prompts-limit", args.prompts_limit is not None),
                ("--prompts-split", args.prompts_split != "all"),
                ("--prompts-category", bool(args.prompts_category)),
            )
            if given
        ]
        if picked:
            raise UsageError(f"{picked[0]} selects from --prompts FILE; add --prompts FILE.")
        return
    others = [
        name
        for name, given in (
            ("--prompt", bool(args.prompt)),
            ("--prompt-set", args.prompt_set is not None),
            ("--prompt-ids", args.prompt_ids is not None),
            ("--requests", args.requests is not None),
        )
        if given
    ]
    if others:
        raise UsageError(f"--prompts FILE is the prompt source; drop {others[0]}.")


def _prompt_file(args: argparse.Namespace) -> Any:
    if args.prompts is None:
        return None
    from specport.bench.prompt_sets import PromptFileChoice

    return PromptFileChoice(
        path=args.prompts,
        limit=args.prompts_limit,
        split=args.prompts_split,
        seed=args.seed,
        categories=tuple(dict.fromkeys(args.prompts_category)),
    )


def _run_engines(args: argparse.Namespace) -> int:

    if args.peer or args.prompt_ids or args.batch != [1] or args.tree_width:
        raise UsageError(
            "--requests takes --prompt-len, --new-tokens, --runs, --threads, --request-rate, "
            "--seed (and --speculative "
            "METHOD, --num-draft, --draft, --spec-max-rows) only; drop --peer, --prompt-ids, "
            "--batch and --tree-width."
        )
    if args.speculative and len(args.speculative) != 1:
        raise UsageError("--requests takes one --speculative METHOD; run once per method.")
    counts = list(dict.fromkeys(args.requests))
    reports = []
    for n in counts:
        report = _run_engine_speculative(args, n) if args.speculative else _run_engine(args, n)
        reports.append(report)
        if not args.json:
            print(_engine_table(args)(report), flush=True)
            if len(counts) > 1:
                print(flush=True)
    if args.plot:
        from specport.bench.plot import load_chart

        load_chart(_load_series(reports), args.plot, _load_title(args, reports[0]))
        if not args.json:
            print(f"chart: {args.plot}")
    if args.json:
        emit_json(reports[0] if len(reports) == 1 else {"requests": reports})
    return 0


def _engine_table(args: argparse.Namespace) -> Callable[[Any], str]:
    if args.speculative:
        from specport.bench.engine_spec import format_spec_engine_table

        return format_spec_engine_table
    from specport.bench.engine import format_engine_table

    return format_engine_table


def _load_series(reports: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Each engine's output tokens/s and TTFT p50/p99 at each --requests N (`latency`)."""
    series: dict[str, list[dict[str, Any]]] = {}
    for report in reports:
        for engine, summary in report["latency"].items():
            series.setdefault(engine, []).append(
                {
                    "concurrency": report["config"]["requests"],
                    "output_tok_per_s": summary["output_tok_per_s"],
                    "ttft_ms_p50": summary["ttft_ms_p50"],
                    "ttft_ms_p99": summary["ttft_ms_p99"],
                }
            )
    return series


def _load_title(args: argparse.Namespace, report: dict[str, Any]) -> str:
    import os

    cfg = report["config"]
    what = f"speculative {args.speculative[0]} vs plain" if args.speculative else "engines"
    return (
        f"{what}: {cfg['new_tokens']} new tokens, {cfg['threads']} threads, "
        f"{cfg['rounds']} rounds; load average {os.getloadavg()[0]:.1f}"
    )


def _run_engine(args: argparse.Namespace, requests: int) -> dict[str, Any]:
    from specport.bench.engine import EngineBenchConfig, run_engine_bench

    config = EngineBenchConfig(
        requests=requests,
        new_tokens=args.new_tokens,
        prompt_tokens=args.prompt_len,
        rounds=args.runs,
        threads=args.threads,
        prefix_tokens=args.prefix_tokens,
        request_rate=_finite(args.request_rate),
        seed=args.seed,
    )
    return dict(run_engine_bench(args.artifact, config))


def _run_engine_speculative(args: argparse.Namespace, requests: int) -> dict[str, Any]:
    from specport.bench.engine_spec import SpecEngineBenchConfig, run_spec_engine_bench

    config = SpecEngineBenchConfig(
        requests=requests,
        new_tokens=args.new_tokens,
        prompt_tokens=args.prompt_len,
        rounds=args.runs,
        threads=args.threads,
        method=args.speculative[0],
        num_draft=args.num_draft,
        draft=args.draft,
        spec_max_rows=args.spec_max_rows,
        spec_max_tokens=args.spec_max_tokens,
        prompt_set=args.prompt_set,
        request_rate=_finite(args.request_rate),
        seed=args.seed,
        suffix_corpus=args.suffix_corpus,
    )
    return dict(run_spec_engine_bench(args.artifact, config))


def _draft(args: argparse.Namespace) -> str | None:
    """--draft as a folder: `self` is made (or found) here, so every engine and peer that
    drafts with it (OpenVINO GenAI's `+draft` reads the folder's source) gets the same file."""
    if not is_self(args.draft):
        return args.draft
    from pathlib import Path

    from specport.artifact.manifest import read_manifest

    target = Path(args.artifact)
    return str(ensure_self_draft(target, read_manifest(target, check_hashes=False)))


def _emit(args: argparse.Namespace, report: Any, table: Callable[[Any], str]) -> int:
    """The report as one JSON object (--json) or as its table."""
    if args.json:
        emit_json(report)
    else:
        print(table(report))
    return 0


def _request_rate(text: str) -> float:
    """--request-rate: a positive number of requests per second, or inf (all at once)."""
    try:
        value = float(text)
    except ValueError:
        raise UsageError(f"--request-rate must be a number of requests/s, got {text!r}.") from None
    if not value > 0:  # also nan
        raise UsageError(f"--request-rate must be > 0 requests/s (or inf), got {text}.")
    return value


def _finite(rate: float | None) -> float | None:
    """A finite request rate, or None for all at once (inf, or not given): JSON has no inf."""
    return rate if rate is not None and math.isfinite(rate) else None


def _num_draft(args: argparse.Namespace) -> int:
    """--num-draft, or a default that fits every method benchmarked (an MTP artifact's heads)."""
    if args.num_draft is not None:
        return int(args.num_draft)
    if "mtp" in (args.speculative or []):
        from specport.artifact.manifest import read_manifest

        heads = int((read_manifest(args.artifact, check_hashes=False).mtp or {}).get("heads") or 0)
        if heads:
            return heads
    return 4
