"""Bits per weight over a whole model file, the way llama.cpp reports a GGUF's size.

A 4-bit scheme's name says nothing about the file: onnxruntime's MatMulNBits keeps one float32
scale per block (1 bit per weight at block 32) and zero points, the embedding table is gathered
from its own initializer, and a tied LM head is stored a second time as the head's quantized
MatMul weight. So we count what is stored: every byte of weights and of their scales and zero
points, divided by the model's parameter count (a tied embedding counted once, as in the float
source and in llama.cpp's `n_params`). Two things are not weights and are left out of both:
rotary cos/sin tables (llama.cpp computes them at load) and small integer constants (shapes,
split sizes); the file's total size is reported beside the figure.

The graph is read without its external data: sizes come from each tensor's dims and type (or
its recorded external-data length), so this runs in milliseconds on any model size.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import onnx

# A 4-bit weight with float zero points is stored as symmetric MatMulNBits codes plus these
# per-block offsets (passes/quant/weight_only.py): its zero points in another form.
BLOCK_OFFSETS_SUFFIX = ".block_offsets"

# (op type, input index) -> role of the initializer found there. Inputs absent here default to
# "weight" for float initializers (norm scales, float MatMul weights, biases).
ROLES: dict[tuple[str, int], str] = {
    ("MatMulNBits", 1): "codes",
    ("MatMulNBits", 2): "scales",
    ("MatMulNBits", 3): "zero_points",
    ("MatMulNBits", 4): "skip",  # g_idx: a permutation, not a weight
    ("GatherBlockQuantized", 0): "codes",
    ("GatherBlockQuantized", 1): "skip",  # the ids (never an initializer in practice)
    ("GatherBlockQuantized", 2): "scales",
    ("GatherBlockQuantized", 3): "zero_points",
    ("DequantizeLinear", 0): "codes",
    ("DequantizeLinear", 1): "scales",
    ("DequantizeLinear", 2): "zero_points",
    ("DynamicQuantizeMatMul", 1): "codes",
    ("DynamicQuantizeMatMul", 2): "scales",
    ("DynamicQuantizeMatMul", 3): "zero_points",
    ("MatMulInteger", 1): "codes",
    ("MatMulInteger", 3): "zero_points",
    ("QLinearMatMul", 1): "scales",
    ("QLinearMatMul", 2): "zero_points",
    ("QLinearMatMul", 3): "codes",
    ("QLinearMatMul", 4): "scales",
    ("QLinearMatMul", 5): "zero_points",
    ("QLinearMatMul", 6): "scales",
    ("QLinearMatMul", 7): "zero_points",
    ("GroupQueryAttention", 7): "rope",
    ("GroupQueryAttention", 8): "rope",
    ("RotaryEmbedding", 2): "rope",
    ("RotaryEmbedding", 3): "rope",
}
FLOATS: set[int] = {
    int(onnx.TensorProto.FLOAT),
    int(onnx.TensorProto.FLOAT16),
    int(onnx.TensorProto.BFLOAT16),
    int(onnx.TensorProto.DOUBLE),
}
SUB_BYTE: dict[int, int] = {int(onnx.TensorProto.INT4): 4, int(onnx.TensorProto.UINT4): 4}


@dataclass
class WeightSize:
    """What a model stores. `params`: logical weight elements (a tied embedding once);
    `weight_bytes`: every weight, scale and zero-point byte; `by_role`: those bytes split into
    float weights, integer codes, scales and zero points; `file_bytes`: the graph plus its
    external data as they lie on disk (0 when unknown)."""

    params: int
    weight_bytes: int
    by_role: dict[str, int] = field(default_factory=dict)
    file_bytes: int = 0
    excluded_bytes: int = 0  # rotary tables and integer constants

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.weight_bytes / max(self.params, 1)

    def record(self) -> dict[str, Any]:
        """The manifest's / JSON output's form."""
        return {**asdict(self), "bits_per_weight": round(self.bits_per_weight, 4)}

    def line(self) -> str:
        """'5.12 bits per weight (86.1 MB of weights and scales, 134.5M parameters; file 88.2 MB)'."""
        text = (
            f"{self.bits_per_weight:.2f} bits per weight ({self.weight_bytes / 1e6:.1f} MB of "
            f"weights, scales and zero points over {self.params / 1e6:.1f}M parameters"
        )
        return text + (f"; files {self.file_bytes / 1e6:.1f} MB)" if self.file_bytes else ")")


def _nbytes(t: onnx.TensorProto) -> int:
    for entry in t.external_data:
        if entry.key == "length":
            return int(entry.value)
    n = 1
    for d in t.dims:
        n *= int(d)
    if t.data_type in SUB_BYTE:
        return -(-n * SUB_BYTE[t.data_type] // 8)
    if t.HasField("raw_data") and t.raw_data:
        return len(t.raw_data)
    return n * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize


def _numel(t: onnx.TensorProto) -> int:
    n = 1
    for d in t.dims:
        n *= int(d)
    return n


def _attr(node: onnx.NodeProto, name: str, default: int = 0) -> int:
    for a in node.attribute:
        if a.name == name:
            return int(a.i)
    return default


def _logical_params(node: onnx.NodeProto, t: onnx.TensorProto) -> int:
    """The weight elements a quantized tensor stands for (packed codes hold several)."""
    if node.op_type == "MatMulNBits":
        return _attr(node, "K") * _attr(node, "N")
    if node.op_type == "GatherBlockQuantized":
        bits = _attr(node, "bits", 4)
        per_byte = 8 // bits if t.data_type == onnx.TensorProto.UINT8 else 1
        return _numel(t) * per_byte
    return _numel(t)


def graph_weight_size(proto: onnx.ModelProto, tied: tuple[int, int] | None = None) -> WeightSize:
    """Count a graph's weights (see the module docstring). `tied` = (vocab, hidden) of a model
    with tied embeddings: when both a quantized head [hidden -> vocab] and a gathered table
    [vocab, hidden] are stored, the parameters are counted once (the bytes twice)."""
    inits = {t.name: t for t in proto.graph.initializer}
    roles: dict[str, tuple[str, int]] = {}  # initializer -> (role, logical params)
    head_params = table_params = 0
    # A quantized op's reading decides a tensor's role, whatever else reads it (a gathered
    # table may Reshape the head's codes): those first, every other use after.
    uses = [(n, i, name) for n in proto.graph.node for i, name in enumerate(n.input)]
    uses.sort(key=lambda u: (u[0].op_type, u[1]) not in ROLES)
    for node, i, name in uses:
        if name not in inits or name in roles:
            continue
        t = inits[name]
        role = ROLES.get((node.op_type, i))
        if name.endswith(BLOCK_OFFSETS_SUFFIX):
            role = "zero_points"
        if role is None:
            role = "weight" if t.data_type in FLOATS else "skip"
        params = _logical_params(node, t) if role in ("codes", "weight") else 0
        roles[name] = (role, params)
        if tied and role == "codes":
            v, h = tied
            if node.op_type == "MatMulNBits" and params == v * h and _attr(node, "N") == v:
                head_params = params
            if node.op_type == "GatherBlockQuantized" and params == v * h:
                table_params = params
    by_role: dict[str, int] = {}
    params = excluded = 0
    for name, t in inits.items():
        role, p = roles.get(name, ("weight" if t.data_type in FLOATS else "skip", _numel(t)))
        size = _nbytes(t)
        if role in ("rope", "skip"):
            excluded += size
            continue
        by_role[role] = by_role.get(role, 0) + size
        params += p
    if head_params and table_params:
        params -= head_params  # one tied matrix, stored twice
    return WeightSize(params, sum(by_role.values()), by_role, 0, excluded)


def model_weight_size(
    model_file: str | os.PathLike[str], tied: tuple[int, int] | None = None
) -> WeightSize:
    """`graph_weight_size` of an .onnx file, with the graph and external data files' sizes."""
    path = Path(model_file)
    proto = onnx.load(str(path), load_external_data=False)
    size = graph_weight_size(proto, tied)
    files = {path}
    for t in proto.graph.initializer:
        for entry in t.external_data:
            if entry.key == "location":
                files.add(path.parent / entry.value)
    size.file_bytes = sum(f.stat().st_size for f in files if f.is_file())
    return size


def artifact_weight_size(directory: str | os.PathLike[str], manifest: Any) -> WeightSize:
    """An artifact's size: the graph's count, with the parameter count of the float model it
    was quantized from when quantize recorded it (`quant.size.params`)."""
    c = manifest.config or {}
    tied = None
    if c.get("tie_word_embeddings") and c.get("vocab_size") and c.get("hidden_size"):
        tied = (int(c["vocab_size"]), int(c["hidden_size"]))
    size = model_weight_size(Path(directory) / manifest.model_file, tied)
    recorded = ((manifest.quant or {}).get("size") or {}).get("params")
    if isinstance(recorded, int) and recorded > 0:
        size.params = recorded
    return size
