"""The fastest a decode step of this artifact can be on onnxruntime's own kernels.

A decode step streams every weight once through vector-by-matrix kernels (MatMul, MatMulNBits,
DynamicQuantizeMatMul). This module rebuilds exactly those kernels — same ops, shapes, dtypes and
attributes, random weights of the same bytes — as independent nodes in one graph, and times one
run. Nothing else of the step is there (no attention, norms, activations, no dependency between
layers), so no runtime built on these kernels, ours or a peer, can step faster on this machine.
`peer TPOT / kernel floor` is then the largest speedup over that peer any such runtime could show.
"""

from __future__ import annotations

import logging
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from specport.bench.hardware import plain_decode_nodes

logger = logging.getLogger(__name__)

# Ops whose first input is the activation [rows, K] and whose weight is an initializer.
_WEIGHT_OPS = ("MatMul", "MatMulNBits", "DynamicQuantizeMatMul")


def _reduction_dim(node: Any, inits: dict[str, Any]) -> int | None:
    if node.op_type == "MatMulNBits":
        for attr in node.attribute:
            if attr.name == "K":
                return int(attr.i)
        return None
    weight = inits.get(node.input[1]) if len(node.input) > 1 else None
    if weight is None or len(weight.dims) != 2:
        return None
    return int(weight.dims[0])


def _random_like(tensor: Any, rng: np.random.Generator) -> np.ndarray:
    """Random bytes of the initializer's shape and dtype (zero pages would be read from cache)."""
    import onnx

    dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)
    shape = tuple(int(d) for d in tensor.dims)
    if np.issubdtype(dtype, np.floating):
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)


def floor_graph(model_path: Path, rows: int = 1) -> tuple[bytes, dict[str, np.ndarray], int]:
    """(serialized ONNX model of the artifact's weight kernels, feeds, weight bytes covered)."""
    import onnx
    from onnx import helper, numpy_helper

    proto = onnx.load(str(model_path), load_external_data=False)
    inits = {t.name: t for t in proto.graph.initializer}
    rng = np.random.default_rng(0)
    nodes: list[Any] = []
    initializers: list[Any] = []
    outputs: list[Any] = []
    activations: dict[int, str] = {}  # reduction dim K -> the float input [rows, K]
    covered = 0
    copied: set[str] = set()
    for node in plain_decode_nodes(proto):  # an MTP artifact's heads run only when drafting
        if node.op_type not in _WEIGHT_OPS or len(node.input) < 2:
            continue
        # Every input after the activation must be a weight (an initializer) to stand alone.
        if any(name and name not in inits for name in node.input[1:]):
            continue
        k = _reduction_dim(node, inits)
        if k is None:
            continue
        for name in node.input[1:]:
            if name and name not in copied:
                initializers.append(numpy_helper.from_array(_random_like(inits[name], rng), name))
                copied.add(name)
                covered += initializers[-1].ByteSize()
        out = f"y{len(nodes)}"
        x_name = activations.setdefault(k, f"x_{k}")
        nodes.append(
            helper.make_node(node.op_type, [x_name, *node.input[1:]], [out], domain=node.domain)
        )
        nodes[-1].attribute.extend(node.attribute)
        outputs.append(helper.make_tensor_value_info(out, onnx.TensorProto.FLOAT, None))
    graph_inputs = [
        helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, [rows, k])
        for k, name in activations.items()
    ]
    graph = helper.make_graph(nodes, "kernel_floor", graph_inputs, outputs, initializers)
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 10
    feeds = {
        name: rng.standard_normal((rows, k), dtype=np.float32) for k, name in activations.items()
    }
    return model.SerializeToString(), feeds, covered


class KernelFloor:
    """The artifact's weight kernels in a session of their own, sampled after the benchmark rounds.

    `session_config`: the artifact's own session config entries (e.g. int8 activations for
    MatMulNBits), so onnxruntime picks the kernels the artifact runs with."""

    def __init__(
        self,
        model_path: Path,
        threads: int = 0,
        rows: int = 1,
        session_config: dict[str, str] | None = None,
    ) -> None:
        import onnxruntime as ort

        blob, feeds, self.weight_bytes = floor_graph(model_path, rows)
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.log_severity_level = 3
        so.add_session_config_entry("session.intra_op.allow_spinning", "1")
        for key, value in (session_config or {}).items():
            so.add_session_config_entry(key, value)
        self.session = ort.InferenceSession(blob, so, providers=["CPUExecutionProvider"])
        # OrtValues in, OrtValues out: a numpy round trip per output would be timed too.
        self._values = {name: ort.OrtValue.ortvalue_from_numpy(a) for name, a in feeds.items()}
        self._names = [o.name for o in self.session.get_outputs()]
        for _ in range(3):
            self._run()
        self.samples_ms: list[float] = []

    def _run(self) -> float:
        t0 = time.perf_counter()
        self.session.run_with_ort_values(self._names, self._values)
        return time.perf_counter() - t0

    def sample(self, repeats: int = 9) -> float:
        """Median ms of `repeats` runs; kept for the summary."""
        ms = statistics.median(self._run() for _ in range(repeats)) * 1e3
        self.samples_ms.append(ms)
        return ms

    def summary(self) -> dict[str, Any]:
        return {
            "median_ms": round(statistics.median(self.samples_ms), 3) if self.samples_ms else None,
            "best_ms": round(min(self.samples_ms), 3) if self.samples_ms else None,
            "weight_bytes": self.weight_bytes,
            "method": "the artifact's MatMul / MatMulNBits / DynamicQuantizeMatMul kernels alone, "
            "as shipped, random weights, one onnxruntime run",
        }

    def close(self) -> None:
        del self.session
