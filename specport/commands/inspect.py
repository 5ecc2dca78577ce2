"""`specport inspect ARTIFACT`: what is in an artifact, checked.

Also takes a bare .onnx file: it is checked as `specport optimize` checks its input (readable,
weights present, onnx's checker) and summarised (opset, inputs, outputs, ops).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from specport.cli import emit_json


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
        "verify": {
            k: manifest.verify.get(k)
            for k in ("ok", "max_abs_logits", "skipped")
            if k in manifest.verify
        },
        "tokenizer": manifest.tokenizer.get("kind"),
        "files": {name: digest[:12] for name, digest in manifest.files.items()},
        "source": manifest.source,
    }


def lm_head_line(quant: dict[str, Any] | None) -> str | None:
    """The quantized LM head's precision and, when `--lm-head-bits auto` chose it, why."""
    if not quant or quant.get("lm_head_bits") is None or quant.get("scheme") in (None, "none"):
        return None
    bits = quant["lm_head_bits"]
    text = f"{bits} bits" if bits else "float"
    reason = (quant.get("lm_head") or {}).get("reason")
    return f"{text} (auto: {reason})" if reason else text


def runtimes(manifest: Any, directory: str) -> dict[str, dict[str, Any]]:
    """Which runtimes run the artifact (recorded at write time; worked out for older artifacts)."""
    from specport.exporter.interop import runtimes_of

    return runtimes_of(manifest, Path(directory))


def run(args: argparse.Namespace) -> int:
    from specport.artifact import read_manifest

    if Path(args.artifact).is_file() and Path(args.artifact).suffix == ".onnx":
        info = summarize_onnx(args.artifact)
        checked = "graph passes onnx's checker; external data present"
    else:
        manifest = read_manifest(args.artifact)
        info = {**summarize(manifest), "runtimes": runtimes(manifest, args.artifact)}
        checked = "all file hashes match"
    if args.json:
        emit_json(info)
        return 0
    width = max(len(k) for k in info)
    for key, value in info.items():
        if key == "files":
            value = ", ".join(f"{n} ({d})" for n, d in value.items())
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
    """A bare ONNX file, checked (see `specport.onnx_file`) without loading its weights."""
    from collections import Counter

    import onnx

    from specport.onnx_file import check_onnx_input

    proto = check_onnx_input(path)

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
    }
