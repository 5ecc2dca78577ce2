"""The torch_npu kernel table: which Ascend fused kernel implements each specport op.

Not a graph rewrite: a torch_npu runtime (eager PyTorch on Ascend) calls these kernels where the
ONNX graph has the matching specport op. `kernel_table()` checks torch_npu is importable so a
user without it gets a clear error instead of an AttributeError deep in a run.
"""

from __future__ import annotations

import importlib.util
import logging

from specport.core.errors import ProviderError

logger = logging.getLogger(__name__)

KERNELS: dict[str, str] = {
    "RMSNorm": "torch_npu.npu_rms_norm",
    "SkipRMSNorm": "torch_npu.npu_rms_norm",  # after an in-place residual add
    "RotaryEmbedding": "torch_npu.npu_rotary_mul",
    "GroupQueryAttention": "torch_npu.npu_fused_infer_attention_score",
    "MatMulW8A8": "torch_npu.npu_quant_matmul",
    "MatMulW4": "torch_npu.npu_weight_quant_batchmatmul",
}


def available() -> bool:
    return importlib.util.find_spec("torch_npu") is not None


def kernel_table() -> dict[str, str]:
    """specport op -> torch_npu kernel; raises ProviderError when torch_npu is not installed."""
    if not available():
        raise ProviderError(
            "target torch_npu needs the torch_npu package (Ascend PyTorch adapter): install it "
            "with the CANN toolkit, or pick --target cann/cpu/cuda/neutral"
        )
    import torch_npu  # noqa: F401

    missing = [k for k in KERNELS.values() if not hasattr(torch_npu, k.split(".", 1)[1])]
    if missing:
        logger.warning("torch_npu lacks kernels %s (old version?)", missing)
    return dict(KERNELS)
