"""`--keep-gguf-quant`: MatMul weights become MatMulNBits built from the GGUF file's own blocks.

The default GGUF export dequantizes every weight to float32; re-quantizing that graph would round
a second time. This pass instead reads each MatMul's tensor from the file and maps its blocks
onto MatMulNBits (passes/quant/gguf_blocks.py): exact for Q4_0, Q8_0, Q5_0 and Q6_K, to about
one float32 ulp for the 4-bit affine types (Q4_1, Q4_K, whose minimum becomes a float zero
point); Q5_1/Q5_K would need 8-bit float zero points, which onnxruntime's CPU kernel refuses. Each site is checked against the float weight already in the graph (which is
gguf's dequantization of the same blocks) and its largest difference is reported; a site whose
tensor has another type (F32, F16, Q2_K, ...) stays in float and says so.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from specport.artifact.files import write_artifact_manifest
from specport.artifact.manifest import DATA_NAME, MANIFEST_NAME, atomic_artifact_dir, read_manifest
from specport.core.errors import QuantizationError
from specport.exporter.gguf_import import tensor_plan
from specport.exporter.gguf_tensors import permuted_heads, unpermute
from specport.passes.base import Pass
from specport.passes.quant import gguf_blocks
from specport.passes.quant.blockquant import BlockQuant, dequantize
from specport.passes.quant.graph import WeightSite, find_weight_matmuls, remove_unused
from specport.passes.quant.weight_only import QuantizeWeightsNBitsPass

logger = logging.getLogger(__name__)

# Largest |difference| from gguf's float dequantization tolerated for the affine types
# (relative to the block's largest weight): a float zero point costs about one ulp.
AFFINE_RTOL = 1e-5


def _hf_name(site: WeightSite) -> str:
    """The Hugging Face parameter behind a site's initializer ("model.<hf name>[.T]")."""
    name = site.weight.name or ""
    name = name.removeprefix("model.")
    return name.removesuffix(".T")


class KeepGGUFQuantPass(Pass):
    """Replace MatMul weights with MatMulNBits holding the GGUF file's codes, scales and minimums."""

    name = "keep_gguf_quant"

    def __init__(self, gguf_path: str | Path, accuracy_level: int | None = None) -> None:
        self.gguf_path = Path(gguf_path)
        self.accuracy_level = accuracy_level

    def precondition(self, model: ir.Model) -> str | None:
        return None if find_weight_matmuls(model) else "no MatMul with a constant 2-D float weight"

    def rewrite(self, model: ir.Model) -> tuple[bool, dict[str, Any]]:
        reader, plan = tensor_plan(self.gguf_path)
        by_hf = {hf: g for g, hf in plan.hf_names.items()}
        if "lm_head.weight" not in by_hf and "model.embed_tokens.weight" in by_hf:
            by_hf["lm_head.weight"] = by_hf["model.embed_tokens.weight"]  # tied head
        tensors = {t.name: t for t in reader.tensors}
        layers: dict[str, Any] = {}
        pending: list[tuple[WeightSite, BlockQuant]] = []
        for site in find_weight_matmuls(model):
            gname = by_hf.get(_hf_name(site))
            if gname is None:
                layers[site.name] = {"bits": 32, "reason": "no GGUF tensor for this weight"}
                continue
            t = tensors[gname]
            qtype = t.tensor_type.name
            if qtype in gguf_blocks.AFFINE_8BIT:
                reason = (
                    "8-bit codes with float zero points: onnxruntime's CPU MatMulNBits refuses them"
                )
                layers[site.name] = {"bits": 32, "gguf_type": qtype, "reason": reason}
                continue
            if qtype not in gguf_blocks.SUPPORTED:
                layers[site.name] = {"bits": 32, "gguf_type": qtype, "reason": "kept in float"}
                continue
            bq = gguf_blocks.block_quant(np.asarray(t.data), qtype, site.n, site.k)
            heads = permuted_heads(plan, gname)
            if heads:
                bq = dataclasses.replace(
                    bq,
                    q=unpermute(bq.q, heads),
                    scale=unpermute(bq.scale, heads),
                    zero=unpermute(bq.zero, heads),
                )
            w = site.weight_array()
            diff = float(np.abs(dequantize(bq) - w).max())
            scale = float(np.abs(w).max()) or 1.0
            exact = qtype in gguf_blocks.EXACT
            if (exact and diff != 0.0) or diff > AFFINE_RTOL * scale:
                raise QuantizationError(
                    f"GGUF tensor {gname} ({qtype}) does not match the exported weight of "
                    f"{site.name} (max |diff| {diff:.3g}); the artifact was not exported from "
                    f"{self.gguf_path}. Pass the GGUF file the artifact came from."
                )
            pending.append((site, bq))
            layers[site.name] = {
                "bits": bq.bits,
                "gguf_type": qtype,
                "group_size": bq.group_size,
                "exact": diff == 0.0,
                "max_abs_diff": diff,
            }
        emitter = QuantizeWeightsNBitsPass(accuracy_level=self.accuracy_level)
        groups: dict[Any, list[tuple[WeightSite, BlockQuant]]] = {}
        for site, bq in pending:  # pack siblings (q/k/v, gate/up) that share a block layout
            key = (id(site.x), bq.bits, bq.integer_zero, bq.group_size, bq.symmetric)
            groups.setdefault(None if site.lm_head else key, []).append((site, bq))
        for key, group in groups.items():
            if key is None or len(group) == 1:
                for item in group:
                    emitter._emit_nbits(model.graph, *item)
            else:
                emitter._emit_packed(model.graph, group)
        remove_unused(model)
        if pending and model.opset_imports.get("com.microsoft", 0) < 1:
            model.opset_imports["com.microsoft"] = 1
        kept = sorted({v["gguf_type"] for v in layers.values() if v.get("bits", 32) < 32})
        if any(t in gguf_blocks.APPROX for t in kept):
            logger.warning(
                "%s blocks keep their minimum as float zero points: onnxruntime's CPU "
                "MatMulNBits runs those on a slow path (SmolLM2-135M Q4_1 decoded 12x slower "
                "than float32). For speed, export without --keep-gguf-quant and quantize.",
                "/".join(t for t in kept if t in gguf_blocks.APPROX),
            )
        return bool(pending), {
            "gguf": str(self.gguf_path),
            "accuracy_level": self.accuracy_level or 0,
            "exact_types": sorted(t for t in kept if t in gguf_blocks.EXACT),
            "affine_types": sorted(t for t in kept if t in gguf_blocks.APPROX),
            "max_abs_diff": max((v.get("max_abs_diff", 0.0) for v in layers.values()), default=0.0),
            "layers": layers,
        }


def keep_gguf_quant_artifact(
    src: str | Path, out: str | Path, gguf_path: str | Path, accuracy_level: int | None = None
) -> Any:
    """Artifact exported from `gguf_path` -> artifact whose MatMuls hold the file's own blocks."""
    src_p, out_p = Path(src), Path(out)
    manifest = read_manifest(src_p)
    if manifest.kv.layout != "concat":
        raise QuantizationError(
            "--keep-gguf-quant needs the concat KV layout (the shared layout packs q/k/v into "
            "one weight); export without --kv-layout shared."
        )
    if manifest.quant:
        raise QuantizationError(f"{src_p} is already quantized; start from the float export.")
    model = ir.load(src_p / manifest.model_file)
    result = KeepGGUFQuantPass(gguf_path, accuracy_level)(model)
    with atomic_artifact_dir(out_p) as tmp:
        ir.save(model, tmp / manifest.model_file, external_data=DATA_NAME)
        del model
        for f in src_p.iterdir():
            if f.is_file() and f.name not in (MANIFEST_NAME, manifest.model_file, DATA_NAME):
                shutil.copyfile(f, tmp / f.name)
        report = result.report
        manifest.passes = [*manifest.passes, report]
        manifest.quant = {
            "scheme": "gguf",
            "form": "matmulnbits",
            "accuracy_level": report.get("accuracy_level", 0),
            "exact_types": report.get("exact_types", []),
            "affine_types": report.get("affine_types", []),
            "max_abs_weight_diff": report.get("max_abs_diff", 0.0),
            "layers": {k: v.get("bits") for k, v in report.get("layers", {}).items()},
        }
        write_artifact_manifest(tmp, manifest)
    logger.info("kept the GGUF blocks of %s in %s", gguf_path, out_p)
    return manifest
