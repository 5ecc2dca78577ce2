"""specport optimize vs onnxruntime's transformer optimizer on the attention corpus (not a test).

    .venv/bin/python -m benchmarks.bench_attention_vs_ort [--root DIR] [--repeat 30] [--only NAME]

Inputs: every graph of `tests/passes/attention_families.py` (tiny GPT-2 / BERT / DistilBERT / Llama /
Megatron graphs from torch.onnx's TorchScript and dynamo exporters, and blocks written node by
node the way onnxruntime's fusion tests write them). Each goes through
  specport  `specport.optimize(src, out)` (target cpu; its own check against onnxruntime on
            the input runs too)
  ort       `onnxruntime.transformers.optimizer.optimize_model(src, model_type, num_heads,
            hidden_size)` with the entry's model_type (gpt2 or bert), default opt_level
and per graph we report: main-graph nodes before and after, fused attention nodes (Attention in
either domain, MultiHeadAttention, GroupQueryAttention), Softmax left, the max |difference| of
every output against onnxruntime running the input (same random inputs, built by
`specport.core.onnx_parity`: B=2, S=3, past 4 when the graph has a past), and the forward time of
both outputs (B=1, S=16, past 16; median of interleaved rounds, one thread).
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.bench_exports import fused_attention
from tests.passes.attention_families import build_corpus

logger = logging.getLogger(__name__)

TIMED = (1, 16, 16)  # batch, new tokens, past tokens of the timed forward


def _session(path: Path, threads: int = 1) -> Any:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _feeds(sess: Any, proto: Any, batch: int, seq: int, past: int) -> dict[str, np.ndarray]:
    from specport.core.onnx_parity import Case, _role, make_feeds

    has_past = any(_role(i.name) == "past" for i in sess.get_inputs())
    made = make_feeds(sess, proto, Case(batch, seq, past if has_past else 0, has_past), seed=1)
    if made is None:
        raise ValueError("no random inputs for this graph")
    return made[0]


def _ort_optimize(src: Path, out: Path, model_type: str, heads: int, hidden: int) -> Path:
    from onnxruntime.transformers.optimizer import optimize_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = optimize_model(str(src), model_type=model_type, num_heads=heads, hidden_size=hidden)
    out.parent.mkdir(parents=True, exist_ok=True)
    opt.save_model_to_file(str(out))
    return out


def _row(name: str, entry: Any, src: Path, root: Path) -> tuple[dict[str, Any], dict[str, Path]]:
    import onnx

    import specport

    row: dict[str, Any] = {"family": entry.family, "exporter": entry.exporter}
    proto = onnx.load(str(src), load_external_data=False)
    row["nodes_before"] = len(proto.graph.node)
    outs: dict[str, Path] = {}
    try:
        out, report = specport.optimize(src, root / "out" / name / "specport.onnx")
        outs["specport"] = out
        row["specport_parity"] = report.get("parity", {})
    except Exception as e:  # noqa: BLE001 - a failure is a finding
        row["specport_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    try:
        outs["ort"] = _ort_optimize(
            src, root / "out" / name / "ort.onnx", entry.model_type, entry.heads, entry.hidden
        )
    except Exception as e:  # noqa: BLE001
        row["ort_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    ref = _session(src)
    feeds = _feeds(ref, proto, 2, 3, 4)
    want = ref.run(None, feeds)
    for tool, path in outs.items():
        p = onnx.load(str(path), load_external_data=False)
        row[f"{tool}_nodes"] = len(p.graph.node)
        row[f"{tool}_attention"] = fused_attention(p)
        row[f"{tool}_softmax"] = sum(n.op_type == "Softmax" for n in p.graph.node)
        got = _session(path).run(None, feeds)
        row[f"{tool}_max_diff"] = max(
            float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max(initial=0))
            for a, b in zip(want, got)
        )
    return row, outs


def run(root: Path, repeat: int, only: str | None = None) -> dict[str, Any]:
    import onnx

    from benchmarks.bench_fusion import _bound_run, _interleaved

    rows: dict[str, dict[str, Any]] = {}
    for name, (entry, src) in build_corpus(root / "corpus", only).items():
        row, outs = _row(name, entry, src, root)
        rows[name] = row
        if len(outs) == 2:
            proto = onnx.load(str(src), load_external_data=False)
            fns = {}
            for tool, path in outs.items():
                sess = _session(path)
                fns[tool] = _bound_run(sess, _feeds(sess, proto, *TIMED), False)
            try:
                for tool, t in _interleaved(fns, repeat).items():
                    row[f"{tool}_ms"] = t["median_ms"]
            except Exception as e:  # noqa: BLE001 - a graph that fixed a dim at export
                row["time_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        logger.info("%s: %s", name, row)
    return {"repeat": repeat, "rows": rows}


def print_table(res: dict[str, Any]) -> None:
    print(
        "| graph | exporter | nodes in | nodes specport / ort | attention fused specport / ort "
        "| max diff specport / ort | forward ms specport / ort |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, r in res["rows"].items():

        def pair(key: str, fmt: str = "{}", r: dict[str, Any] = r) -> str:
            vals = []
            for tool in ("specport", "ort"):
                if f"{tool}_error" in r:
                    vals.append("failed")
                elif f"{tool}_{key}" in r:
                    vals.append(fmt.format(r[f"{tool}_{key}"]))
                else:
                    vals.append("-")
            return " / ".join(vals)

        print(
            f"| {name} | {r['exporter']} | {r['nodes_before']} | {pair('nodes')} "
            f"| {pair('attention')} | {pair('max_diff', '{:.1e}')} | {pair('ms', '{:.3f}')} |"
        )
    for name, r in res["rows"].items():
        if "time_error" in r:
            print(f"\n{name}: not timed: {r['time_error']}")
        for tool in ("specport", "ort"):
            if f"{tool}_error" in r:
                print(f"\n{name}: {tool} failed: {r[f'{tool}_error']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", type=Path, default=Path(tempfile.gettempdir()) / "specport_attn")
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--only")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    res = run(args.root, args.repeat, args.only)
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        print_table(res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
