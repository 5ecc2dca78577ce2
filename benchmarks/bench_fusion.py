"""CPU timing of fused vs unfused graphs on a ~30M-parameter Llama (not a test).

    python -m benchmarks.bench_fusion [--threads 2] [--repeat 30] [--json]
    python -m benchmarks.bench_fusion --inputs exports [--only 8x512]   # vs peers on other
                                                 # exporters' graphs

Exports LlamaForCausalLM(8 layers, hidden 512, 8 heads / 4 KV heads, vocab 8192, intermediate
1408) with random weights once (cached under specport.core.settings.cache_dir()), builds each
variant with `optimize_model`, and times a decode step (B=1, S=1, past 64) and a prefill
(B=1, S=128, past 0) and a long-context decode (past 1024) in onnxruntime CPU sessions. Median and min milliseconds are reported,
with op counts of the main graph, so the speedup is tied to what the fusions changed.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.timing import BENCH_CONFIG, bound_run, export_llama30m, interleaved

logger = logging.getLogger(__name__)

SHARED_T = 1152  # shared-layout buffer length (covers past 1024 + a step)

VARIANTS: dict[str, dict[str, Any] | None] = {
    "unfused": None,
    "cpu": {},
    "cpu_contrib_rmsnorm": {"rms_norm": "contrib"},
    "neutral": {"target": "neutral"},
    "cpu_shared_kv": {"kv_layout": "shared", "max_length": 1152},
}


def _feeds(dims, s: int, p: int, vocab: int) -> dict[str, np.ndarray]:
    from tests.passes.graph_models import make_feeds

    return make_feeds(dims, 1, s, p, vocab, seed=1)


def _shared_feeds(dims, s: int, p: int, vocab: int, t: int) -> dict[str, np.ndarray]:
    n_layers, hkv, hd = dims
    rng = np.random.default_rng(1)
    feeds: dict[str, np.ndarray] = {
        "input_ids": rng.integers(0, vocab, (1, s), dtype=np.int64),
        "position_ids": np.arange(p, p + s, dtype=np.int64)[None],
        "seqlens_k": np.array([p + s - 1], np.int32),
        "total_sequence_length": np.array(p + s, np.int32),
    }
    for i in range(n_layers):
        for kv in ("key", "value"):
            feeds[f"past_key_values.{i}.{kv}"] = rng.standard_normal((1, hkv, t, hd), np.float32)
    return feeds


def run_bench(threads: int = 1, repeat: int = 30, root: Path | None = None) -> dict[str, Any]:
    from specport.passes.base import op_counts
    from specport.passes.pipelines import optimize_model
    from tests.passes.graph_models import cpu_session

    root = Path(root or _cache_root())
    src = export_llama30m(root)
    dims = (8, 4, 64)
    vocab = int(BENCH_CONFIG["vocab_size"])
    results: dict[str, Any] = {"threads": threads, "repeat": repeat, "variants": {}}
    decode_fns: dict[str, Any] = {}
    prefill_fns: dict[str, Any] = {}
    long_fns: dict[str, Any] = {}
    for name, opts in VARIANTS.items():
        opts = dict(opts) if opts is not None else None
        if opts is None:
            sess = cpu_session(src, threads=threads)
            import onnx_ir as ir

            counts = op_counts(ir.load(str(src)))
        else:
            target = opts.pop("target", "cpu")
            model, _ = optimize_model(src, target, **opts)
            counts = op_counts(model)
            sess = cpu_session(model, tempfile.mkdtemp(prefix=f"bench_{name}_"), threads=threads)
        shared = name == "cpu_shared_kv"
        if shared:
            decode = _shared_feeds(dims, 1, 64, vocab, SHARED_T)
            long = _shared_feeds(dims, 1, 1024, vocab, SHARED_T)
            prefill = _shared_feeds(dims, 128, 0, vocab, SHARED_T)
        else:
            decode = _feeds(dims, 1, 64, vocab)
            long = _feeds(dims, 1, 1024, vocab)
            prefill = _feeds(dims, 128, 0, vocab)
        decode_fns[name] = bound_run(sess, decode, shared)
        long_fns[name] = bound_run(sess, long, shared)
        prefill_fns[name] = bound_run(sess, prefill, shared)
        results["variants"][name] = {"ops": counts, "nodes": sum(counts.values())}
    for name, model_path in _peer_models(src, root).items():
        # Peers take the same unfused export and keep the concat I/O contract.
        sess = cpu_session(model_path, threads=threads)
        decode_fns[name] = bound_run(sess, _feeds(dims, 1, 64, vocab), False)
        long_fns[name] = bound_run(sess, _feeds(dims, 1, 1024, vocab), False)
        prefill_fns[name] = bound_run(sess, _feeds(dims, 128, 0, vocab), False)
        import onnx_ir as ir

        counts = op_counts(ir.load(str(model_path)))
        results["variants"][name] = {"ops": counts, "nodes": sum(counts.values())}
    for name, t in interleaved(decode_fns, repeat).items():
        results["variants"][name]["decode_past64"] = t
    for name, t in interleaved(long_fns, max(5, repeat // 2)).items():
        results["variants"][name]["decode_past1024"] = t
    for name, t in interleaved(prefill_fns, max(5, repeat // 4)).items():
        results["variants"][name]["prefill_128"] = t
    base = results["variants"]["unfused"]
    for v in results["variants"].values():
        keys = (
            ("decode_past64", "decode"),
            ("decode_past1024", "long"),
            ("prefill_128", "prefill"),
        )
        for key, short in keys:
            v[f"{short}_speedup_median"] = round(base[key]["median_ms"] / v[key]["median_ms"], 2)
            v[f"{short}_speedup_min"] = round(base[key]["min_ms"] / v[key]["min_ms"], 2)
    return results


def _peer_models(src: Path, root: Path) -> dict[str, Path]:
    """The same export optimized by onnxscript's `optimize_for_ort` and by onnxruntime's own
    `transformers.optimizer`; a peer that fails on this graph is reported and left out."""
    import onnx_ir as ir

    peers: dict[str, Path] = {}
    try:
        from onnxscript.rewriter.ort_fusions import optimize_for_ort

        model = ir.load(str(src))
        optimize_for_ort(model)
        out = root / "peer_optimize_for_ort" / "model.onnx"
        out.parent.mkdir(parents=True, exist_ok=True)
        ir.save(model, out, external_data="model.onnx.data")
        peers["peer_optimize_for_ort"] = out
    except Exception as e:  # noqa: BLE001 - a peer's failure is a finding, not our crash
        logger.warning("onnxscript optimize_for_ort failed on this graph: %s", e)
    try:
        from onnxruntime.transformers.optimizer import optimize_model as ort_optimize

        opt = ort_optimize(
            str(src),
            model_type="gpt2",  # its decoder-with-past fusions; no dedicated Llama type here
            num_heads=int(BENCH_CONFIG["num_attention_heads"]),
            hidden_size=int(BENCH_CONFIG["hidden_size"]),
            opt_level=1,
        )
        out = root / "peer_ort_transformers_optimizer" / "model.onnx"
        out.parent.mkdir(parents=True, exist_ok=True)
        opt.save_model_to_file(str(out), use_external_data_format=True)
        peers["peer_ort_transformers_optimizer"] = out
    except Exception as e:  # noqa: BLE001
        logger.warning("onnxruntime.transformers optimizer failed on this graph: %s", e)
    return peers


def _cache_root() -> Path:
    try:
        from specport.core.settings import cache_dir

        return Path(cache_dir()) / "bench"
    except Exception:  # settings without cache_dir: fall back to a temp folder
        return Path(tempfile.gettempdir()) / "specport_bench"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--inputs",
        choices=["llama30m", "exports"],
        default="llama30m",
        help="llama30m: fusion variants on one dynamo export; exports: specport vs onnxscript "
        "vs onnxruntime on Optimum / TorchScript exports (passes/bench_exports.py)",
    )
    ap.add_argument("--only", help="with --inputs exports: inputs whose name contains this")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    if args.inputs == "exports":
        from benchmarks.bench_exports import print_table, run_exports_bench

        out = run_exports_bench(_cache_root(), args.repeat, args.threads, only=args.only)
        print(json.dumps(out)) if args.json else print_table(out)
        return 0
    res = run_bench(args.threads, args.repeat)
    if args.json:
        print(json.dumps(res))
        return 0
    print("median / min ms (speedup vs unfused by median / by min)")
    head = f"{'variant':<20}{'decode past64':>26}{'decode past1024':>26}{'prefill 128':>26}"
    print(head + f"{'nodes':>7}")
    for name, v in res["variants"].items():
        row = f"{name:<20}"
        for key, short in (
            ("decode_past64", "decode"),
            ("decode_past1024", "long"),
            ("prefill_128", "prefill"),
        ):
            t = v[key]
            row += f"{t['median_ms']:>9.2f}/{t['min_ms']:<7.2f}"
            row += f"x{v[short + '_speedup_median']:.2f}/{v[short + '_speedup_min']:.2f}"
        print(row + f"{v['nodes']:>7}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
