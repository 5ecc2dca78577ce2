"""`specport inspect ARTIFACT`: what is in an artifact, checked."""

from __future__ import annotations

import argparse
from typing import Any

from specport.cli import emit_json


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="summarise an artifact (checks schema and file hashes)")
    p.add_argument("artifact")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run)


def summarize(manifest: Any) -> dict[str, Any]:
    c = manifest.config
    return {
        "architecture": manifest.architecture,
        "schema_version": manifest.schema_version,
        "target": manifest.target,
        "dtype": manifest.dtype,
        "opset": manifest.opset,
        "layers": c.get("num_layers"),
        "heads": c.get("num_heads"),
        "kv_heads": c.get("num_kv_heads"),
        "head_dim": c.get("head_dim"),
        "hidden": c.get("hidden_size"),
        "vocab": c.get("vocab_size"),
        "context": c.get("context_length"),
        "kv_layout": manifest.kv.layout,
        "inputs": [i["name"] for i in manifest.io.get("inputs", [])],
        "outputs": [o["name"] for o in manifest.io.get("outputs", [])],
        "passes": [p.get("name") for p in manifest.passes],
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
        "runtimes": _runtimes(manifest),
    }


def _runtimes(manifest: Any) -> dict[str, dict[str, Any]]:
    """Which runtimes run the artifact (recorded at write time; worked out for older artifacts)."""
    from specport.exporter.interop import runtimes_of

    return runtimes_of(manifest)


def run(args: argparse.Namespace) -> int:
    from specport.artifact import read_manifest

    manifest = read_manifest(args.artifact)
    info = summarize(manifest)
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
    print("all file hashes match")
    return 0
