"""`quantize_artifact`: artifact in, quantized artifact out (the API and CLI call this).

Schemes:
  w4a16  4-bit blockwise weights, MatMulNBits (float activations)
  w4a8   same weights, MatMulNBits accuracy_level=4 (int8 activations inside the kernel)
  w8a16  8-bit blockwise weights, MatMulNBits
  w8a8   int8 weights + int8 activations, SmoothQuant; form matmulnbits (default: MatMulNBits
         8-bit blocks of 64, accuracy_level 4, dynamic per-row-and-block activations), dynamic
         (DynamicQuantizeMatMul) or qdq (static per-tensor activations); without calibration
         text, matmulnbits round-to-nearest with no SmoothQuant (what llama.cpp's Q8_0 needs)
The int8-activation schemes record whether the graph is row-invariant (a verify run computes
each token as a one-token step does, so greedy speculation keeps plain greedy's tokens:
`quant.token_exact_speculation`, passes/quant/row_invariance.py); `exact_speculation` makes it
so by padding every attention run to two query rows (passes/pad_attention_rows.py).
Both KV layouts: a `shared` artifact is quantized as it is (calibration runs the shared graph),
so the quantized model keeps the IO-bound decode loop; its int8 KV cache lives in
GroupQueryAttention's in-place buffers (passes/quant/kv_cache_shared.py).
Algorithms (weight-only schemes): rtn, hqq (no calibration); gptq, clip, default (GPTQ with
MSE-clipped group ranges; calibrated); ort-default / ort-hqq run onnxruntime's own
MatMulNBitsQuantizer on the same graph, as baselines.
Scheme `none` leaves the weights in float; with kv_cache="int8" (passes/quant/kv_cache.py) the
KV cache is int8 with calibrated scales (per KV head on concat, per channel by default on shared),
alone or on top of any weight scheme.
The option checks live in passes/quant/checks.py, calibration in calibration.py, the
onnxruntime baselines in ort_baseline.py; this module runs the recipe and writes the artifact.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from specport.artifact.eval_record import EVAL_KEY, SOURCE_EVAL_KEY, source_eval_for_quantized
from specport.artifact.files import write_artifact_manifest
from specport.artifact.manifest import (
    DATA_NAME,
    MANIFEST_NAME,
    Manifest,
    atomic_artifact_dir,
    read_manifest,
)
from specport.core.errors import QuantizationError
from specport.core.options import option
from specport.core.weight_size import artifact_weight_size, model_weight_size
from specport.passes.base import PassResult
from specport.passes.mtp_graphs import write_mtp_graphs
from specport.passes.pad_attention_rows import PadAttentionRowsPass
from specport.passes.quant import calibration as C
from specport.passes.quant.budget import BudgetPlan, plan_bit_budget
from specport.passes.quant.checks import (
    check_budget_options,
    check_frequent_head_rows,
    check_kv_layout,
    check_kv_options,
    check_weight_options,
    default_group_size,
)
from specport.passes.quant.embedding import QuantizeEmbeddingPass
from specport.passes.quant.graph import find_weight_matmuls
from specport.passes.quant.head import check_head_bits, choose_lm_head_bits, head_wide
from specport.passes.quant.kv_cache import apply_int8_kv, int8_kv_manifest
from specport.passes.quant.kv_check import check_artifact
from specport.passes.quant.mixed import plan_mixed_precision
from specport.passes.quant.npu import npu_qdq_pass
from specport.passes.quant.ort_baseline import run_ort_baseline
from specport.passes.quant.ort_check import integer_kernel_summary
from specport.passes.quant.row_invariance import portable, token_exact_report
from specport.passes.quant.sensitivity import measure_group_kl
from specport.passes.quant.vocab_split import (
    can_split,
    check_split,
    split_head_record,
    split_plan,
    split_report,
    split_tied_head,
)
from specport.passes.quant.w8a8 import QuantizeW8A8Pass, kv_values_of
from specport.passes.quant.weight_only import QuantizeWeightsNBitsPass

logger = logging.getLogger(__name__)

INT8_ACTIVATION_SCHEMES = ("w4a8", "w8a8")

Progress = Callable[[str, int, int], None]

__all__ = ["Progress", "quantize_artifact"]


FORMS_INT8_KERNEL = ("matmulnbits", "dynamic")  # onnxruntime kernels quantizing activations


def cann_w8a8_form(manifest: Manifest, scheme: str, form: str) -> str:
    """A `cann` artifact's W8A8 takes Ascend's layout (`ascend` form): the CANN provider has no
    com.microsoft kernels, so the default MatMulNBits form becomes `ascend` and `dynamic` is
    refused; `qdq` (uint8 activations, standard ops) is kept when asked for."""
    if manifest.target != "cann" or scheme != "w8a8" or form in ("ascend", "qdq"):
        return form
    if form == "dynamic":
        raise QuantizationError(
            "the dynamic W8A8 form uses com.microsoft.DynamicQuantizeMatMul, which the CANN "
            "provider cannot run; quantize this cann artifact with --form ascend"
        )
    logger.info("cann artifact: W8A8 in Ascend's layout (form ascend) instead of %s", form)
    return "ascend"


def quantize_artifact(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    scheme: str = "w4a16",
    group_size: int | None = None,
    algo: str = "default",
    calib_files: Sequence[str | os.PathLike[str]] = (),
    mixed_precision: str = "off",
    progress: Progress | None = None,
    calib_docs: int = 300,
    lm_head_bits: int | str | None = None,
    embedding_bits: int | None = None,
    form: str = "matmulnbits",
    float_zero: bool = False,
    kv_cache: str = "float",
    kv_clip: str = "absmax",
    symmetric: bool = False,
    kv_granularity: str | None = None,
    kv_float_layers: Sequence[int] | str = (),
    lm_head_group_size: int | None = None,
    bits_per_weight: float | None = None,
    mixture: str | None = None,
    exact_speculation: bool = False,
    frequent_head_rows: int | None = None,
    keep_kv_values: bool = False,
) -> Manifest:
    """Quantize artifact `src` into a new artifact `out`; returns the new manifest.

    The manifest's `quant` records the recipe, per-layer precision and the calibration hash,
    and each pass report is appended to `passes`. `scheme="none"` keeps float weights (for a
    KV-only recipe); `kv_cache="int8"` adds the calibrated int8 KV cache (`quant.kv_cache`),
    with `kv_granularity` scales (None: the layout's default, see `default_kv_granularity`)
    and `kv_float_layers` kept float32 (shared layout), then checks chat answers (kv_check.py).
    `group_size` None: `default_group_size` (32 for weight-only schemes, 64 for w8a8).
    `lm_head_group_size` None: the LM head's block size by `head_group_size`'s rule (an 8-bit
    head with int8 activations takes a larger block than the body).
    `bits_per_weight` (or a named `mixture`, budget.MIXTURES): every tensor's width and block,
    the LM head and embedding table included, planned by measured error so that the whole
    file holds at most that many bits per parameter (passes/quant/budget.py).
    `exact_speculation` (w4a8, w8a8): pad every attention run to two query rows, so greedy
    speculation gives plain greedy's tokens; it costs plain decoding a dummy attention row per
    step (SmolLM2 W8A8: 1.15-1.18x CPU per token, see pad_attention_rows.py), so it is asked for.
    `frequent_head_rows` (w4a8): the tied LM head and table are split by vocabulary rows and
    the first ids (BPE's most frequent tokens) kept at 8 bits (passes/quant/vocab_split.py);
    the rest is planned by a budget, or 4-bit without one. None: a budget's planner chooses
    how many, 0 for a whole head, by token-frequency-weighted error (passes/quant/head_rows.py),
    and without a budget the head stays whole; 0: never split.
    `keep_kv_values` (w8a8): no SmoothQuant scale goes into the value projection, so the KV
    cache holds the source model's values (`quant.kv_values`: "source"), as a draft that
    drafts in its float target's cache needs (runtime/speculative/draft.py).
    """
    src_p, out_p = Path(src), Path(out)
    target_bpw = check_budget_options(
        scheme, algo, form, mixed_precision, lm_head_bits, embedding_bits, bits_per_weight, mixture
    )
    check_frequent_head_rows(frequent_head_rows, scheme, target_bpw, lm_head_bits)
    if keep_kv_values and scheme != "w8a8":
        raise QuantizationError(
            f"{option('keep_kv_values')} is a w8a8 option (only its SmoothQuant folds change "
            f"the cached values); {scheme} keeps the source model's KV values already"
        )
    if group_size is None:
        group_size = default_group_size(scheme, exact_speculation)
    if target_bpw is not None:
        lm_head_bits, embedding_bits = 0, 0  # placeholders: the budget plans both
    if lm_head_bits is None and scheme == "w4a8" and not algo.startswith("ort-"):
        lm_head_bits = "auto"  # 4 or 8 bits by measured cost and effect (passes/quant/head.py)
    if lm_head_bits is None:
        # An 8-bit head where activations are int8 anyway (w4a8, w8a8: MatMulNBits with
        # accuracy_level 4 runs int8 VNNI/AMX kernels; 1.05-1.08x slower decode than a 4-bit head on
        # the 32M Llama, but a 4-bit head costs stories260K +1.2% ppl). w4a16/w8a16 keep a float
        # head: onnxruntime 1.31's CPU MatMulNBits with float activations has no fast 8-bit path.
        lm_head_bits = 8 if scheme in ("w8a8", "w4a8") else 0
    if embedding_bits is None:
        # 4-bit artifacts gather from an 8-bit table instead of keeping it in fp32 (a 152k x 896
        # table is 545 MB of a 0.5B model's 4-bit artifact); measured on stories260K W4A8: 8-bit
        # table +0.01% ppl, 4-bit +0.26%. The table is gathered, not streamed per token.
        embedding_bits = 8 if scheme in ("w4a16", "w4a8") and form != "npu" else 0
    if algo == "default" and not calib_files and scheme != "w8a8" and mixed_precision == "off":
        algo = "hqq"  # the best calibration-free algorithm
        logger.info("no calibration text: using hqq")
    check_kv_options(scheme, algo, kv_cache, kv_clip, calib_files, kv_granularity, kv_float_layers)
    check_weight_options(scheme, algo, group_size, calib_files, mixed_precision, form)
    check_head_bits(scheme, algo, lm_head_bits)
    manifest = read_manifest(src_p)
    # The source's recorded perplexity describes the source, not this artifact: carried as the
    # reference a later `eval ppl --record` on the same text compares against.
    source_eval = source_eval_for_quantized(manifest) or manifest.extra.get(SOURCE_EVAL_KEY)
    manifest.extra.pop(EVAL_KEY, None)
    manifest.extra.pop(SOURCE_EVAL_KEY, None)
    if source_eval:
        manifest.extra[SOURCE_EVAL_KEY] = source_eval
    check_kv_layout(src_p, manifest, kv_cache, kv_granularity)
    form = cann_w8a8_form(manifest, scheme, form)
    model_path = src_p / manifest.model_file
    # The float model's parameter count: the quantized graph stores a tied embedding twice
    # (gathered table and head), which must not count as more parameters.
    source_size = artifact_weight_size(src_p, manifest)
    source_params = source_size.params
    prior_quant, kv_report = manifest.quant, {}  # scheme none keeps the source's weight recipe
    if frequent_head_rows:
        check_split(ir.load(model_path), frequent_head_rows)  # before calibration
    # A tied head split by vocabulary rows: where the planner chooses (None), where the user
    # said (N), or kept whole (0); the split itself happens after planning.
    split_head = (
        frequent_head_rows != 0
        and target_bpw is not None
        and scheme == "w4a8"
        and (bool(frequent_head_rows) or can_split(ir.load(model_path)))
    )
    stats = None
    if calib_files and not algo.startswith("ort-") and scheme != "none" and form != "npu":
        stats = C.calibrate_artifact(model_path, manifest, src_p, calib_files, calib_docs, progress)
    bits = 8 if scheme == "w8a16" else 4
    accuracy_level = 4 if scheme == "w4a8" else None
    reports: list[dict[str, Any]] = []
    per_layer: dict[str, Any] = {}
    exact: dict[str, Any] | None = None  # int8 activations: can speculation keep the tokens?
    manifest_head: dict[str, Any] | None = None  # auto's decision and what it measured
    budget_report: dict[str, Any] | None = None  # a size budget's plan (budget.py)
    budget: BudgetPlan | None = None
    embedding_group = group_size
    with atomic_artifact_dir(out_p) as tmp:
        if algo.startswith("ort-"):
            reports.append(
                run_ort_baseline(
                    model_path, tmp / manifest.model_file, algo, group_size, accuracy_level
                )
            )
        else:
            model = ir.load(model_path)
            passes: list[Any] = []
            plan: dict[str, int] | None = None
            groups: dict[str, int] | None = None
            if mixed_precision == "auto" and scheme != "w8a8":
                assert stats is not None
                plan, plan_report = plan_mixed_precision(model, stats, bits, group_size, algo)
                reports.append(plan_report)
            elif target_bpw is not None:
                if progress:
                    progress("measuring every tensor's widths", 0, 1)
                loss = None
                token_ids = None
                if calib_files:  # every tensor's error in one unit: the loss (sensitivity.py)
                    seqs, feeds = C.calibration_sequences(manifest, src_p, calib_files, calib_docs)
                    token_ids = np.concatenate(seqs) if seqs else None
                    loss = measure_group_kl(
                        model_path,
                        find_weight_matmuls(model),
                        seqs,
                        feeds,
                        symmetric=symmetric,
                        progress=(lambda i, n: progress("loss per group", i, n))
                        if progress
                        else None,
                    )
                budget, budget_report = plan_bit_budget(
                    model,
                    stats,
                    target_bpw,
                    source_params,
                    source_size.weight_bytes,
                    widths=(4, 8) if scheme == "w4a8" else (4,),
                    symmetric=symmetric,
                    loss=loss,
                    float_zero=float_zero,
                    split_head=split_head,
                    split_rows=frequent_head_rows or None,
                    token_ids=token_ids,
                )
                reports.append(budget_report)
                plan, groups = budget.bits, budget.groups
                head = [
                    n for n, t in budget_report["tensors"].items() if t["kind"].startswith("head")
                ]
                lm_head_bits = plan[head[0]] if head else 0
                if budget.frequent_rows:  # the planner split the tied head
                    split = split_tied_head(model, budget.frequent_rows)
                    budget.assign_split(model, split.frequent, split.rare)
                    reports.append(split_report(split))
                    choice = "given" if frequent_head_rows else "planned"
                    manifest_head = split_head_record(split, choice, int(lm_head_bits))
                embedding_bits, embedding_group = budget.table or (0, group_size)
            if frequent_head_rows and target_bpw is None:  # outside a budget: 8 and 4 bits
                split = split_tied_head(model, frequent_head_rows)
                plan = {**(plan or {}), **split_plan(model, split)}
                lm_head_bits = 4
                reports.append(split_report(split))
                manifest_head = split_head_record(split, "given", 4)
            if scheme == "none":
                pass
            elif form == "npu":  # QDQ, uint16 activations (passes/quant/npu.py)
                args = (model_path, manifest, src_p, calib_files, bits, group_size)
                passes.append(npu_qdq_pass(*args, max_docs=calib_docs, progress=progress))
            elif scheme == "w8a8":
                if stats is None:
                    logger.info("no calibration text: 8-bit round-to-nearest, no SmoothQuant")
                passes.append(
                    QuantizeW8A8Pass(
                        stats,
                        lm_head_bits=int(lm_head_bits),
                        group_size=group_size,
                        form=form,
                        keep_kv_values=keep_kv_values,
                    )
                )
            else:
                auto_head = lm_head_bits == "auto"
                nbits = QuantizeWeightsNBitsPass(
                    bits,
                    group_size,
                    "rtn" if algo == "default" and bits == 8 else algo,
                    stats=stats,
                    form=form,
                    accuracy_level=accuracy_level,
                    lm_head_bits=head_wide(scheme) if auto_head else int(lm_head_bits),
                    plan=plan,
                    float_zero=float_zero,
                    symmetric=symmetric,
                    lm_head_group_size=lm_head_group_size,
                    group_plan=groups,
                    float_zero_sites=budget.float_zero if budget is not None else None,
                )
                if auto_head:
                    if progress:
                        progress("measuring the LM head at 4 bits", 0, 1)
                    nbits.lm_head_bits, head_report = choose_lm_head_bits(
                        model, stats, nbits, head_wide(scheme)
                    )
                    lm_head_bits = nbits.lm_head_bits
                    reports.append(head_report)
                    manifest_head = {
                        k: head_report[k]
                        for k in ("choice", "bits", "reason", "cost", "measured", "rule")
                        if k in head_report
                    }
                passes.append(nbits)
            if embedding_bits:
                table_group = embedding_group if target_bpw is not None else group_size
                shared = nbits.tied_heads if budget is not None and budget.shared else None
                passes.append(
                    QuantizeEmbeddingPass(
                        bits=embedding_bits, group_size=table_group, shared=shared
                    )
                )
            for p in passes:
                if progress:
                    progress(p.activity or p.name, 0, 1)
                result: PassResult = p(model)
                reports.append(result.report)
                per_layer.update(result.report.get("layers", {}))
            if kv_cache == "int8":  # calibrated on the graph as it runs, after the weight passes
                kv_args = (manifest, src_p, calib_files, calib_docs, kv_clip, progress)
                kv_report = apply_int8_kv(
                    model,
                    None if passes else model_path,
                    *kv_args,
                    granularity=kv_granularity,
                    float_layers=kv_float_layers,
                )
                reports.append(kv_report)
            if scheme in INT8_ACTIVATION_SCHEMES:
                if exact_speculation:  # verify runs and one-token steps round alike
                    reports.append(PadAttentionRowsPass()(model).report)
                exact = token_exact_report(model)
                if exact["exact"] and not portable(exact["kernels"]):
                    logger.warning(
                        "greedy speculation on this file gives plain greedy's tokens on this "
                        "CPU, not on every CPU: its int8 kernels %s are row-invariant here but "
                        "not on every CPU measured (4-bit blocks of 32 differ on AVX2); "
                        "--group-size 16 makes a file exact on all of them",
                        exact["kernels"],
                    )
            if progress:
                progress("writing the quantized graph", 0, 1)
            ir.save(model, tmp / manifest.model_file, external_data=DATA_NAME)
        for f in src_p.iterdir():
            if f.is_file() and f.name not in (MANIFEST_NAME, manifest.model_file, DATA_NAME):
                shutil.copyfile(f, tmp / f.name)
        manifest.passes = [*manifest.passes, *reports]
        head_rows = [
            v
            for v in per_layer.values()
            if isinstance(v, dict) and v.get("lm_head") and "group_size" in v
        ]
        manifest.quant = {
            "scheme": scheme,
            "algorithm": algo,
            "group_size": group_size,
            "form": form,
            "accuracy_level": 4 if scheme in ("w4a8", "w8a8") and form in FORMS_INT8_KERNEL else 0,
            "lm_head_bits": lm_head_bits,
            **({"lm_head_group_size": head_rows[0]["group_size"]} if head_rows else {}),
            **({"lm_head": manifest_head} if manifest_head else {}),
            "float_zero_points": float_zero,
            "symmetric": symmetric,
            "embedding_bits": embedding_bits,
            "mixed_precision": mixed_precision,
            "kv_values": kv_values_of(reports),
            **({"token_exact_speculation": exact} if exact is not None else {}),
            "layers": {
                k: v.get("bits") if isinstance(v, dict) else v for k, v in per_layer.items()
            },
            "calibration": None
            if not calib_files
            else {
                "files": [Path(f).name for f in calib_files],
                "sha256": C.files_sha256(calib_files),
                "docs": calib_docs,
            },
        }
        if form == "npu":  # the CPU provider must not turn DQ->MatMul into int8 activations
            manifest.quant["ort_session_config"] = {"session.qdq_matmulnbits_accuracy_level": "0"}
            manifest.quant["activation_dtype"] = "uint16"
            manifest.quant.update(algorithm="minmax", symmetric=True, lm_head_bits=bits)
            manifest.quant["group_size"] = 0  # per output channel (npu.py says why)
            if not calib_files:
                manifest.quant["calibration"] = {"builtin": "core/corpus.py seed 11"}
        if form == "ascend":
            # What the graph says, on the CPU provider too: onnxruntime's QDQ fusions turn a
            # quantized-output chain into QLinearMatMul with per-channel weight scales, which
            # measured 6% of the largest logit away from the graph's own arithmetic.
            manifest.quant["ort_session_config"] = {"session.disable_quant_qdq": "1"}
        if form == "qdq" and scheme != "w8a8":
            # onnxruntime fuses DQ(int4)->MatMul into MatMulNBits with int8 activations unless
            # told otherwise; the runtime should pass this to SessionOptions for true W4A16.
            level = "4" if scheme == "w4a8" else "0"
            manifest.quant["ort_session_config"] = {"session.qdq_matmulnbits_accuracy_level": level}
        if scheme == "none":
            manifest.quant = dict(prior_quant or {"scheme": "none"})
        if kv_cache == "int8":
            recipe = {
                "dtype": "int8",
                "layout": manifest.kv.layout,
                "granularity": kv_report.get("granularity", "per_kv_head"),
                **(
                    {"quant_type": kv_report.get("quant_type")}
                    if manifest.kv.layout == "shared"
                    else {"axis": 1}
                ),
                "symmetric": True,
                "float_layers": kv_report.get("float_layers", []),
                "clip": kv_clip,
                "calibration": {
                    "files": [Path(f).name for f in calib_files],
                    "sha256": C.files_sha256(calib_files),
                    "docs": calib_docs,
                },
            }
            int8_kv_manifest(manifest, kv_report, recipe)
        if (manifest.mtp or {}).get("heads"):  # the quantized graph's own MTP-less graphs
            write_mtp_graphs(tmp, manifest)
        if scheme != "none":
            size = model_weight_size(tmp / manifest.model_file)
            size.params = source_params
            manifest.quant["size"] = size.record()
            if target_bpw is not None and budget_report is not None:
                manifest.quant["budget"] = {
                    "target_bits_per_weight": target_bpw,
                    "mixture": mixture,
                    **{
                        k: budget_report[k]
                        for k in ("planned_bits_per_weight", "floor_bits_per_weight", "summary")
                    },
                    "tensors": {
                        n: {
                            "bits": t["bits"],
                            "group_size": t["group_size"],
                            **({"float_zero": True} if t.get("float_zero") else {}),
                        }
                        for n, t in budget_report["tensors"].items()
                    },
                }
                if size.bits_per_weight > target_bpw:  # the plan counts these same bytes
                    raise QuantizationError(
                        f"the quantized file holds {size.bits_per_weight:.3f} bits per weight, "
                        f"over the {target_bpw} budget the plan kept to"
                    )
        if progress:
            progress("checking onnxruntime's kernels", 0, 1)
        try:
            manifest.quant["ort_cpu"] = integer_kernel_summary(tmp / manifest.model_file)
        except Exception as e:  # the artifact is still valid for other runtimes
            logger.warning("onnxruntime could not load the quantized graph for inspection: %s", e)
            manifest.quant["ort_cpu"] = {"error": str(e)}
        if kv_cache == "int8" and manifest.kv.layout == "shared":
            if progress:
                progress("checking chat answers", 0, 1)
            check = check_artifact(src_p, tmp, manifest, calib_files)
            if check is not None:
                manifest.quant["kv_cache"]["chat_check"] = check
        write_artifact_manifest(tmp, manifest)
    logger.info("quantized %s -> %s (%s, %s, kv %s)", src_p, out_p, scheme, algo, kv_cache)
    return manifest
