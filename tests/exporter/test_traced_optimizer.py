"""The exporter's optimizer gives the graph torch's own `ONNXProgram.optimize()` gives."""

from __future__ import annotations

import warnings

import onnx_ir as ir
import pytest
import torch

from specport.exporter.onnx_graph import OPSET
from specport.exporter.traced_optimizer import _linear_passes, optimize_traced


class RotateHalfNorm(torch.nn.Module):
    """What a decoder layer feeds the optimizer: an RMS norm, a projection, rotate-half (two
    Slices of one input), and shape arithmetic that folds."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(16))
        self.proj = torch.nn.Linear(16, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight
        x = self.proj(x)
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1) + x


def _traced() -> ir.Model:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            RotateHalfNorm().eval(),
            (torch.rand(2, 3, 16),),
            dynamo=True,
            opset_version=OPSET,
            optimize=False,
            dynamic_shapes=({0: torch.export.Dim("batch"), 1: torch.export.Dim("seq")},),
        )
    assert program is not None
    return program.model


def _signature(model: ir.Model) -> list[tuple[str, list[str], list[str]]]:
    return [
        (n.op_type, [v.name if v else "" for v in n.inputs], [v.name for v in n.outputs])
        for n in model.graph
    ]


def test_same_graph_as_torchs_optimize() -> None:
    from onnxscript import optimizer
    from onnxscript.rewriter import onnx_fusions

    if _linear_passes() is None:
        pytest.skip("this onnxscript lacks the pieces: optimize_traced runs optimize_ir itself")
    ours, torchs = _traced(), _traced()
    optimize_traced(ours)
    optimizer.optimize_ir(torchs)  # what ONNXProgram.optimize() runs
    onnx_fusions.fuse(torchs)
    assert _signature(ours) == _signature(torchs)
    assert [n.op_type for n in ours.graph].count("Slice") == 2  # torch's Slices keep `steps`
    assert "RMSNormalization" in {n.op_type for n in ours.graph}
