"""`specport inspect ARTIFACT`: what is in an artifact, checked.

Also takes a bare .onnx file: it is checked as `specport optimize` checks its input (readable,
weights present, onnx's checker) and summarised (opset, inputs, outputs, ops).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from specport.cli import emit_json
from specport.core import history


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "inspect", help="summarise an artifact (checks schema and file hashes) or an .onnx file"
    )
    p.add_argument("artifact", help="artifact directory, or a bare .onnx file")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run)


def summarize(manifest: Any) -> dict[str, Any]:
    c = manifest.config
    return {
        "architecture": manifest.architecture,
        "schema_version": manifest.schema_version,
        "target": manifest.target,
        "dtype": manifest.dtype,
        **({"dtype_note": manifest.extra["dtype_note"]} if "dtype_note" in manifest.extra else {}),
        "opset": manifest.opset,
        "layers": c.get("num_layers"),
        "heads": c.get("num_heads"),
        "kv_heads": c.get("num_kv_heads"),
        "head_dim": c.get("head_dim"),
        "hidden": c.get("hidden_size"),
        "vocab": c.get("vocab_size"),
        "context": c.get("context_length"),
        "kv_layout": manifest.kv.layout,
        "kv_layout_reason": (manifest.extra.get("kv_layout_choice") or {}).get("reason"),
        "inputs": [i["name"] for i in manifest.io.get("inputs", [])],
        "outputs": [o["name"] for o in manifest.io.get("outputs", [])],
        "passes": [p.get("name") for p in manifest.passes],
        "lm_head": lm_head_line(manifest.quant),
        "quant": manifest.quant,
        "mtp": manifest.mtp,
        "eagle": manifest.extra.get("eagle"),
        "verify": {
            k: manifest.verify.get(k)
            for k in ("ok", "max_abs_logits", "skipped")
            if k in manifest.verify
        },
        "tokenizer": manifest.tokenizer.get("kind"),
        "files": {name: digest[:12] for name, digest in manifest.files.items()},
        "source": manifest.source,
        "eval": manifest.extra.get("eval"),
        "history": history.entries(manifest),
    }


def verify_line(verify: dict[str, Any]) -> str:
    """ "matches PyTorch (max |logits diff| 1.9e-04)" rather than a dict."""
    if verify.get("skipped"):
        why = verify["skipped"]
        return "not checked at export" + (
            f" ({why})" if isinstance(why, str) else " (--skip-verify)"
        )
    diff = verify.get("max_abs_logits")
    detail = f" (max |logits diff| {diff:.2g})" if isinstance(diff, (int, float)) else ""
    return (
        "export matched PyTorch" if verify.get("ok") else "export did NOT match PyTorch"
    ) + detail


def source_line(source: dict[str, Any]) -> str:
    """Where the weights came from, in one line (--json has every detail)."""
    kind, path = source.get("kind"), source.get("path") or source.get("name")
    line = f"{kind} {path}" if path else str(kind)
    gguf = source.get("gguf") or {}
    if gguf.get("tensor_types"):
        types = ", ".join(f"{n} {t}" for t, n in gguf["tensor_types"].items())
        line += f" (GGUF tensors: {types})"
    return line


def eval_line(record: dict[str, Any]) -> str:
    """The recorded perplexity (`eval ppl --record`), beside its float32 reference if known."""
    line = (
        f"perplexity {record['ppl']:.4f} of {record.get('of')} on {record.get('text')} "
        f"({record.get('tokens')} tokens, {record.get('docs')} docs)"
    )
    ref = record.get("reference")
    if ref and "ppl_delta_rel" in record:
        line += f"; {100 * record['ppl_delta_rel']:+.2f}% vs {ref.get('label', 'reference')}"
        line += f" {float(ref['ppl']):.4f}"
    return line


def lm_head_line(quant: dict[str, Any] | None) -> str | None:
    """The quantized LM head's precision and, when `--lm-head-bits auto` chose it, why."""
    if not quant or quant.get("lm_head_bits") is None or quant.get("scheme") in (None, "none"):
        return None
    bits = quant["lm_head_bits"]
    text = f"{bits} bits" if bits else "float"
    head = quant.get("lm_head") or {}
    reason = head.get("reason")
    return f"{text} ({head.get('choice', 'auto')}: {reason})" if reason else text


def size_line(size: dict[str, Any]) -> str:
    """A recorded `WeightSize` (core/weight_size.py) in one line."""
    from specport.core.weight_size import WeightSize

    fields = ("params", "weight_bytes", "by_role", "file_bytes", "excluded_bytes")
    return WeightSize(**{k: size[k] for k in fields if k in size}).line()


def mtp_line(mtp: dict[str, Any]) -> str:
    """The MTP heads in one line (how many, how trained, held-out acceptance, draft vocabulary);
    the whole training record stays in --json."""
    training = mtp.get("training") or {}
    parts = [f"{mtp.get('heads')} heads"]
    if training.get("source"):
        parts.append(str(training["source"]))
    if training.get("steps"):
        parts.append(f"{training['steps']} steps")
    held = (training.get("heldout") or {}).get("mean_accepted_length")
    if held is not None:
        parts.append(f"held-out mean accepted length {held}")
    if training.get("draft_vocab"):
        parts.append(f"draft vocabulary {training['draft_vocab']}")
    if mtp.get("heads_graph"):
        parts.append("heads graph for token trees")
    return ", ".join(parts) + " (full record: --json)"


def eagle_line(eagle: dict[str, Any]) -> str:
    """The EAGLE draft head in one line (graph, features, draft vocabulary, held-out
    acceptance); the whole record stays in --json."""
    training = eagle.get("training") or {}
    layers = ", ".join(str(x) for x in eagle.get("feature_layers") or [])
    graph = f"{eagle.get('graph')} (one layer, own KV)"
    if eagle.get("int8_graph"):
        fused = eagle.get("int8_attention") == "GroupQueryAttention"
        how = "int8 weights, fused attention" if fused else "int8 weights"
        graph += f" and {eagle['int8_graph']} ({how}, run on CPU)"
    parts = [
        graph,
        f"features of layers {layers}",
        f"draft vocabulary {eagle.get('draft_vocab')}",
    ]
    if training.get("minutes") is not None:
        parts.append(f"trained {training['minutes']} min")
    held = training.get("heldout") or {}
    if held.get("expected_tokens_per_step") is not None:
        rates = "/".join(f"{r:.2f}" for r in held.get("acceptance_per_position", []))
        parts.append(
            f"held-out acceptance {rates}, {held['expected_tokens_per_step']} tokens per step"
        )
    return ", ".join(parts) + " (full record: --json)"


def quant_line(quant: dict[str, Any], layer_dtypes: list[str]) -> str:
    """The recipe in one line: weights, then the KV cache as layers per dtype and the range of
    its calibrated scales (the per-layer scales, one block per cache tensor, are in --json)."""
    parts = []
    if quant.get("scheme") not in (None, "none"):
        recipe = f"{quant['scheme']} {quant.get('algorithm') or ''}".strip()
        if quant.get("group_size"):
            recipe += f", group {quant['group_size']}"
        if quant.get("form"):
            recipe += f", {quant['form']}"
        bits = list((quant.get("layers") or {}).values())
        if bits:
            counts = ", ".join(f"{bits.count(b)} at {b}" for b in sorted(set(bits), key=str))
            recipe += f" ({len(bits)} matmuls: {counts} bits)"
        parts.append(recipe)
    kv = quant.get("kv_cache")
    if kv:
        groups: dict[str, list[int]] = {}
        for i, dtype in enumerate(layer_dtypes):
            groups.setdefault(dtype, []).append(i)
        layers = ", ".join(
            f"{dtype} x{len(idx)}" + (f" [{_ranges(idx)}]" if len(groups) > 1 else "")
            for dtype, idx in groups.items()
        )
        scales = list(_floats(kv.get("scales")))
        what = ", ".join(str(kv[k]) for k in ("granularity", "clip") if kv.get(k))
        line = f"KV cache {kv.get('dtype')}{f' ({what})' if what else ''}, layers {layers}"
        if scales:
            tensors = len(kv.get("scales") or {})
            line += f", scales {min(scales):.3g}..{max(scales):.3g} over {tensors} tensors"
        parts.append(line + " (per-layer scales: --json)")
    return "; ".join(parts) or "none"


def _floats(value: Any) -> Any:
    """Every number in a nested record of scales (lists, or per-head min/max dicts)."""
    if isinstance(value, dict):
        for k, v in value.items():
            if k != "shape":
                yield from _floats(v)
    elif isinstance(value, list):
        for v in value:
            yield from _floats(v)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield float(value)


def _ranges(idx: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    out: list[str] = []
    start = prev = idx[0]
    for i in [*idx[1:], None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ", ".join(out)


def runtimes(manifest: Any, directory: str) -> dict[str, dict[str, Any]]:
    """Which runtimes run the artifact (recorded at write time; worked out for older artifacts)."""
    from specport.artifact.files import runtimes_of

    return runtimes_of(manifest, Path(directory))


BATCHED_YES = "yes (the batching engine verifies speculative rows in one run)"
BATCHED_NO = (
    "no: exported before attention was fed query_seqlens, so the batching engine verifies "
    "speculative rows one by one (slower); re-export for batched verification"
)


def batched_verification(manifest: Any, directory: str) -> bool | None:
    """Can the batching engine verify several speculative rows in one run (shared layout only)?

    Older shared-layout exports do not feed GroupQueryAttention `query_seqlens`; they still run,
    but verify row by row (runtime/kv/cache.py: `takes_batched_steps`), which a user only
    finds out from the speed. Read from the graph's structure; the weights stay on disk."""
    if manifest.kv.layout != "shared":
        return None
    from specport.runtime.kv.cache import takes_batched_steps

    return takes_batched_steps(Path(directory) / manifest.model_file)


def run(args: argparse.Namespace) -> int:
    from specport.artifact.manifest import read_manifest
    from specport.core.weight_size import artifact_weight_size

    if Path(args.artifact).is_file() and Path(args.artifact).suffix == ".onnx":
        info = summarize_onnx(args.artifact)
        checked = "onnxruntime loads the graph; external data present"
    else:
        manifest = read_manifest(args.artifact)
        info = {**summarize(manifest), "runtimes": runtimes(manifest, args.artifact)}
        info["size"] = artifact_weight_size(args.artifact, manifest).record()
        batched = batched_verification(manifest, args.artifact)
        if batched is not None:
            info["batched_verify"] = batched
        checked = "all file hashes match"
    if args.json:
        emit_json(info)
        return 0
    info = {k: v for k, v in info.items() if v is not None and v != {}}
    width = max(len(k) for k in info)
    for key, value in info.items():
        if key == "verify":
            value = verify_line(value)
        elif key == "source" and isinstance(value, dict):
            value = source_line(value)
        elif key == "eval" and isinstance(value, dict) and "ppl" in value:
            value = eval_line(value)
        elif key == "files":
            value = ", ".join(f"{n} ({d})" for n, d in value.items())
        elif key == "size" and isinstance(value, dict):
            value = size_line(value)
        elif key == "quant" and value:
            value = quant_line(value, manifest.kv.dtypes())
        elif key == "mtp" and value:
            value = mtp_line(value)
        elif key == "eagle" and value:
            value = eagle_line(value)
        elif key == "history":
            print(
                f"{key:<{width}}  "
                + (
                    f"{len(value)} step{'s' if len(value) > 1 else ''}, oldest first"
                    if value
                    else "none"
                )
            )
            for i, entry in enumerate(value, 1):
                print(f"{'':<{width}}    {i}. {history.describe(entry)}")
            continue
        elif key == "repairs":
            value = "; ".join(value) if value else None
            if value is None:
                continue
        elif key == "batched_verify":
            value = BATCHED_YES if value else BATCHED_NO
        elif key == "runtimes":
            value = "; ".join(
                f"{n}"
                if r.get("status") == "yes"
                else f"{n}: {r.get('status')} ({r.get('reason') or ', '.join(r.get('notes') or [])})"
                for n, r in value.items()
            )
        elif isinstance(value, list):
            value = (
                ", ".join(str(v) for v in value)
                if len(value) < 12
                else f"{', '.join(map(str, value[:6]))}, ... ({len(value)})"
            )
        print(f"{key:<{width}}  {value}")
    print(checked)
    return 0


def summarize_onnx(path: str) -> dict[str, Any]:
    """A bare ONNX file, checked (see `specport.core.onnx_file`) without loading its weights."""
    from collections import Counter

    import onnx

    from specport.core.onnx_file import load_onnx_input

    proto, repairs = load_onnx_input(path)

    def describe(values: Any) -> list[str]:
        out = []
        for v in values:
            t = v.type.tensor_type
            dims = [d.dim_param or d.dim_value for d in t.shape.dim]
            dtype = onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name if t.elem_type else "?"
            out.append(f"{v.name} {dtype}{dims}")
        return out

    ops = Counter(f"{n.domain + '.' if n.domain else ''}{n.op_type}" for n in proto.graph.node)
    return {
        "file": path,
        "opset": {o.domain or "ai.onnx": o.version for o in proto.opset_import},
        "ir_version": proto.ir_version,
        "producer": f"{proto.producer_name} {proto.producer_version}".strip(),
        "inputs": describe(proto.graph.input),
        "outputs": describe(proto.graph.output),
        "nodes": len(proto.graph.node),
        "ops": dict(ops.most_common()),
        "initializers": len(proto.graph.initializer),
        "repairs": repairs,
        "history": history.onnx_history({p.key: p.value for p in proto.metadata_props}),
    }
