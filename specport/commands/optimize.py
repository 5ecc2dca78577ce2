"""`specport optimize IN.onnx --out OUT.onnx`: fuse and lower any ONNX decoder graph.

Works on a bare ONNX file (dynamo or TorchScript export, with or without KV cache): patterns
that do not match leave the graph as it was, and the report says which and why.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import specport
from specport.cli import emit_json
from specport.commands._args import POSITIVE


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("optimize", help="fuse and lower an ONNX graph for a target")
    p.add_argument(
        "model", nargs="?", help="input .onnx file (external data next to it is followed)"
    )
    p.add_argument(
        "--out",
        help="output .onnx (weights go to OUT.onnx.data); new, or an earlier optimize output",
    )
    p.add_argument(
        "--target",
        default="cpu",
        choices=["cpu", "cuda", "cann", "neutral"],
        help="cpu/cuda: onnxruntime contrib ops; cann: standard ops only; "
        "neutral: specport ops with portable function bodies (default cpu)",
    )
    p.add_argument("--passes", help="comma-separated subset of passes (see --list-passes)")
    p.add_argument("--list-passes", action="store_true", help="print pass names and exit")
    p.add_argument(
        "--sliding-window",
        type=POSITIVE,
        help="attention window (tokens) when the graph's mask does not reveal it",
    )
    p.add_argument(
        "--kv-layout",
        default="concat",
        choices=["concat", "shared"],
        help="shared (cpu/cuda): one preallocated KV buffer per layer + seqlens_k inputs",
    )
    p.add_argument("--max-length", type=POSITIVE, help="KV buffer length for --kv-layout shared")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(run=run)
    # -v (the global option): every pattern that almost matched, how far it got and why not


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    """Per pass: matched counts and reasons, plus whole-run op counts before/after."""
    passes = report.get("passes", [])
    out: list[dict[str, Any]] = []
    for p in passes:
        item = {"name": p["name"], "modified": p.get("modified", False)}
        keys = ("matched", "skipped", "note", "rejected", "lowered", "cann", "attention_nodes")
        for key in (*keys, "softmax_left"):
            if key in p:
                item[key] = p[key]
        out.append(item)
    before = passes[0].get("ops_before", {}) if passes else {}
    after = passes[-1].get("ops_after", {}) if passes else {}
    return {
        "target": report.get("target"),
        "passes": out,
        "nodes_before": sum(before.values()),  # main graph + functions + If branches
        "nodes_after": sum(after.values()),
        "ops_before": before,
        "ops_after": after,
    }


def parity_line(parity: dict[str, Any] | None) -> str:
    """One line on the numeric check of the output against onnxruntime running the input."""
    if not parity:
        return "checked: not run"
    if not parity.get("checked"):
        return f"checked: not run ({parity.get('reason')})"
    return (
        f"checked against onnxruntime on the input: max |difference| "
        f"{parity['max_abs_error']:.2g} ({'; '.join(parity['cases'])})"
    )


def run(args: argparse.Namespace) -> int:
    from specport.core.errors import UsageError
    from specport.passes.pipelines import all_pass_names

    if args.list_passes:
        names = all_pass_names()
        emit_json({"passes": names}) if args.json else print("\n".join(names))
        return 0
    if args.model is None or args.out is None:
        raise UsageError("give the input model and --out OUT.onnx (or --list-passes).")
    src = Path(args.model)
    passes = (
        [p.strip() for p in args.passes.split(",") if p.strip()]
        if args.passes is not None
        else None
    )
    options: dict[str, Any] = {}
    if args.sliding_window is not None:
        options["sliding_window"] = args.sliding_window
    if args.kv_layout == "shared":
        options["kv_layout"] = "shared"
        options["max_length"] = args.max_length
    out, report = specport.optimize(src, args.out, target=args.target, passes=passes, **options)
    info = summarize(report)
    info["out"] = str(out)
    info["io_contract"] = report.get("io_contract")
    info["repairs"] = report.get("repairs", [])
    info["parity"] = report.get("parity")
    if args.json:
        emit_json(info)
        return 0
    print(f"{src} -> {out} (target {info['target']})")
    for note in info["repairs"]:
        print(f"  repaired: {note}")
    for p in info["passes"]:
        detail = p.get("matched", p.get("skipped", p.get("lowered", "")))
        if "attention_nodes" in p:  # GroupQueryAttention over a cache, or Attention-23 without
            detail = (
                f"{p['attention_nodes']} fused attention nodes ({p.get('matched', 0)} over a KV "
                f"cache), {p.get('softmax_left', 0)} unfused softmax left"
            )
        if isinstance(detail, dict):
            detail = {k: v for k, v in detail.items() if v} or "nothing matched"
        print(f"  {p['name']:<16} {detail}")
        verbose = getattr(args, "verbose", 0)
        for r in p.get("rejected", []) if verbose else p.get("rejected", [])[:5]:
            where = r.get("at") or r.get("node", "")
            if not verbose:
                print(f"      not fused: {r.get('reason')} ({where})")
                continue
            rule = r.get("stage") or r.get("rule") or p["name"]
            got = f"; matched {r['matched']}" if r.get("matched") else ""
            print(f"      nearest rule at {where}: {rule}{got}; stopped: {r.get('reason')}")
    print(f"  nodes: {info['nodes_before']} -> {info['nodes_after']}")
    print(f"  {parity_line(info['parity'])}")
    return 0
