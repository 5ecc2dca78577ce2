"""`--dtype`: the float type an artifact computes in (weights, activations, KV cache).

float32 is the default. float16 / bfloat16 graphs are made by `passes/convert_floats.py` after
the target's pipeline (the fusions match the traced float32 graph; converting afterwards keeps
them dtype-agnostic); logits stay float32.

What onnxruntime 1.32's CPU provider has (measured with one-node graphs): float16 kernels for
GroupQueryAttention, RotaryEmbedding, (Skip)SimplifiedLayerNormalization, RMSNormalization,
Gather, GatherND and Split, but none for MatMul, Add, Mul, Sigmoid or Softmax, where it inserts
Casts to float32 itself. bfloat16 has no MatMul, GroupQueryAttention or elementwise kernel at all:
a bfloat16 graph cannot run on CPU, so `--dtype bf16` is for `--target cuda`.
"""

from __future__ import annotations

import logging
from typing import Any

from specport.core.errors import ExportError, UsageError
from specport.core.options import option
from specport.passes.convert_floats import ConvertFloatsPass

logger = logging.getLogger(__name__)

# accepted spellings -> numpy's name (what the manifest and the runtime use)
NAMES = {
    "fp32": "float32",
    "float32": "float32",
    "fp16": "float16",
    "float16": "float16",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
}
CHOICES = ("fp32", "fp16", "bf16")
# Verification tolerance vs the float32 PyTorch model: (atol, rtol of max|logits|). float16
# keeps 11 significant bits, bfloat16 8: a few units of the last place after a dozen layers.
TOLERANCE = {"float16": (1e-2, 1e-2), "bfloat16": (5e-2, 5e-2)}
# A cuda-target float16 graph is verified on the CPU provider, whose float16
# GroupQueryAttention is less precise than CUDA's (see float32_ops): 1.60 at max|logits| 33
# on SmolLM2-135M, about 5%.
CPU_CHECK_OF_CUDA_FP16 = (5e-2, 5e-2)
# `specport bench F16 --peer specport:F32` on SmolLM2-135M (README `--dtype`), 2 threads, two
# runs on a loaded machine: decode 1.16x then 0.80x (inconclusive), prefill 0.94x then 0.89x,
# peak RSS 0.58x.
CPU_MEASURED = {
    "decode": "0.80-1.16",
    "prefill": "0.89-0.94",
    "rss": "0.58",
    "model": "SmolLM2-135M",
}


def resolve_dtype(dtype: str, target: str, quant: str | None = None) -> str:
    """numpy's name for `dtype`; refuses what no artifact of `target` can run (UsageError)."""
    name = NAMES.get(str(dtype).lower())
    if name is None:
        raise UsageError(f"{option('dtype')} must be one of {', '.join(CHOICES)}, got {dtype!r}.")
    if name == "float32":
        return name
    if quant is not None:
        raise UsageError(
            f"{option('quant')} quantizes float32 weights; drop {option('dtype', dtype)} "
            "(quantized artifacts keep float32 activations)."
        )
    if target == "neutral":
        raise UsageError(
            f"{option('dtype', dtype)} needs a lowered graph: use {option('target')} cpu, cuda "
            "or cann."
        )
    if target != "cuda":
        missing = cpu_missing_kernel(name)
        if missing is not None:
            raise UsageError(
                f"{option('dtype', dtype)} cannot run on target {target}: onnxruntime's CPU "
                f"provider has no {name} {missing} kernel; use {option('target')} cuda, or "
                f"{option('dtype')} fp16/fp32."
            )
    return name


def cpu_missing_kernel(dtype: str) -> str | None:
    """The op (MatMul, then GroupQueryAttention) onnxruntime's CPU provider cannot run in `dtype`.

    Asked of onnxruntime itself with one-node graphs (milliseconds), so a release that adds the
    kernels lifts the refusal without a code change. A missing float16 kernel is no refusal:
    onnxruntime then inserts Casts to float32 itself.
    """
    import onnxruntime as ort
    from onnx import TensorProto, helper

    elem = TensorProto.FLOAT16 if dtype == "float16" else TensorProto.BFLOAT16
    x = helper.make_tensor_value_info("x", elem, [1, 16])
    w = helper.make_tensor_value_info("w", elem, [16, 16])
    y = helper.make_tensor_value_info("y", elem, None)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "probe", [x, w], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    try:
        ort.InferenceSession(
            model.SerializeToString(),
            providers=["CPUExecutionProvider"],
        )
    except Exception as e:  # noqa: BLE001 - NOT_IMPLEMENTED is the answer we ask for
        logger.debug("cpu %s MatMul: %s", dtype, e)
        return "MatMul"
    return None


def float32_ops(dtype: str, target: str) -> tuple[str, ...]:
    """Ops kept in float32 for `target`: the CPU's float16 GroupQueryAttention.

    Measured on SmolLM2-135M (prefill, batch 2): max |logits - PyTorch float32| was 1.60 with
    onnxruntime 1.32's CPU float16 GroupQueryAttention, 0.32 with attention in float32 (the
    rest float16), and 0.29 for PyTorch's own float16 model. So a float16 artifact for the cpu
    target keeps attention and its KV cache in float32; CUDA's kernel accumulates in float32.
    """
    return ("GroupQueryAttention",) if dtype == "float16" and target == "cpu" else ()


def convert_graph(model: Any, dtype: str, target: str) -> dict[str, Any]:
    """Convert the lowered graph in place; returns the pass report for the manifest."""

    report = ConvertFloatsPass(dtype, keep_ops=float32_ops(dtype, target))(model).report
    if report.get("skipped"):
        raise ExportError(f"--dtype {dtype} could not convert the graph: {report['skipped']}")
    return report


def tolerance(dtype: str, target: str) -> tuple[float, float]:
    """(atol, rtol) for verifying a `dtype` graph of `target` on the CPU provider."""
    if dtype == "float16" and target == "cuda":
        return CPU_CHECK_OF_CUDA_FP16
    return TOLERANCE[dtype]


def verification_plan(dtype: str, target: str) -> tuple[bool, str | None]:
    """(verify on CPU?, why not): a bfloat16 graph has no CPU kernels to verify it with."""
    if dtype == "bfloat16" and cpu_missing_kernel(dtype) is not None:
        return False, (
            f"bfloat16 graph for target {target}: onnxruntime's CPU provider has no bfloat16 "
            "MatMul to verify it with; run `specport eval compare` on a CUDA machine"
        )
    return True, None


def cpu_note(dtype: str, target: str) -> str | None:
    """What a float16 artifact for the CPU gains and costs (logged and written to the manifest)."""
    if dtype != "float16" or target != "cpu":
        return None
    m = CPU_MEASURED
    return (
        f"on onnxruntime's CPU provider float16 decoded {m['decode']}x and prefilled "
        f"{m['prefill']}x the speed of float32 with {m['rss']}x its peak RSS ({m['model']}, 2 "
        "threads; no CPU float16 MatMul: onnxruntime casts around each); float32 stays the "
        "default; attention and its KV cache stay float32"
    )
