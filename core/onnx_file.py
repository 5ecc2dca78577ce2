"""A bare ONNX file in (`specport optimize`) and out: accepted as onnxruntime accepts it,
written atomically.

Refused, each with a one-line message that says what to do: the file is not ONNX (or
truncated), its external weights are missing or short, its opset is newer than this onnx knows,
or onnxruntime itself cannot load it. Blemishes that onnx's checker objects to and onnxruntime
ignores (value_info or outputs without a type, stale shape annotations) are repaired and
reported, not refused: exports in the wild carry them. The output is written to a temp folder
beside `--out`, checked there (for `optimize`: onnxruntime runs it and the input on the same
random inputs, see `specport.core.onnx_parity`) and only then renamed into place, so a failure never
leaves a partial file.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specport.core.errors import InvalidModelError, UsageError
from specport.core.options import option
from specport.core.outputs import OPTIMIZED_MARK, onnx_data_path

logger = logging.getLogger(__name__)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".strip().rstrip(":")


def check_onnx_input(path: str | os.PathLike[str]) -> Any:
    """Read `path`'s graph (weights stay on disk) and run the checks that protect users: the
    file is ONNX and whole, its external weights are there and long enough, its opset is one
    this onnx knows. Returns the ModelProto (no weights loaded)."""
    import onnx
    from onnx.external_data_helper import uses_external_data

    p = Path(path)
    if not p.exists():
        raise UsageError(f"{p} does not exist: pass the path of an .onnx model.")
    if not p.is_file():
        raise UsageError(f"{p} is not a file: pass the path of an .onnx model.")
    try:
        proto = onnx.load(str(p), load_external_data=False)
    except Exception as e:  # noqa: BLE001 - protobuf raises DecodeError, RuntimeWarning, ...
        raise InvalidModelError(
            f"{p} is not a readable ONNX model ({_first_line(e)}); it may be truncated or "
            "another format. Pass an .onnx file, or re-export it."
        ) from None
    if not proto.graph.node:
        raise InvalidModelError(f"{p} has an empty graph (is it an ONNX model?); re-export it.")
    base = p.parent
    for tensor in _all_tensors(proto):
        if not uses_external_data(tensor):
            continue
        info = {e.key: e.value for e in tensor.external_data}
        where = base / info.get("location", "")
        if not where.is_file():
            raise InvalidModelError(
                f"{p}'s weights file {where.name} is missing (tensor {tensor.name}); keep the "
                f".onnx and its external data files together in {base}."
            )
        end = int(info.get("offset", 0) or 0) + int(info.get("length", 0) or 0)
        if end > where.stat().st_size:
            raise InvalidModelError(
                f"{p}'s weights file {where.name} is shorter than the graph expects "
                f"(tensor {tensor.name} ends at byte {end}, the file has {where.stat().st_size}); "
                "it is truncated: copy or re-export it again."
            )
    newest = onnx.defs.onnx_opset_version()
    opset = {o.domain: o.version for o in proto.opset_import}.get("", 0)
    if opset > newest:
        raise InvalidModelError(
            f"{p} uses ONNX opset {opset}, newer than this onnx knows ({newest}); upgrade onnx "
            "(pip install -U onnx) or export with an older opset."
        )
    return proto


def load_onnx_input(path: str | os.PathLike[str]) -> tuple[Any, list[str]]:
    """`check_onnx_input`, then repaired and judged by what onnxruntime accepts.

    Returns (repaired ModelProto without its external weights, one note per repair). Exports
    in the wild carry blemishes that onnx's checker refuses but onnxruntime ignores (graph
    outputs without a type, stale shape annotations); they are repaired here, and only a graph
    that onnx's checker and onnxruntime both refuse is refused, with onnxruntime's reason.
    """
    import onnx

    p = Path(path)
    proto = check_onnx_input(p)
    notes = repair_proto(proto)
    proto, upgraded = upgrade_opset(proto)
    notes += upgraded + _type_outputs(proto)
    try:
        onnx.checker.check_model(_without_weights(proto))
    except Exception as e:  # noqa: BLE001 - ValidationError and friends
        why = ort_load_error(p)
        if why is not None:
            raise InvalidModelError(
                f"onnxruntime cannot load {p} ({why}); fix or re-export the model."
            ) from None
        notes.append(f"onnx's checker objects ({_first_line(e)}) but onnxruntime loads it")
    for note in notes:
        logger.info("%s: %s", p.name, note)
    return proto, notes


def _without_weights(proto: Any) -> Any:
    """A copy for onnx's checker and shape inference, which cannot follow external data from
    memory: each external initializer of the main graph becomes a graph input of its type and
    shape (what the checker and inference need of it); others keep their references."""
    import onnx
    from onnx.external_data_helper import uses_external_data

    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    graph = copy.graph
    inputs = {i.name for i in graph.input}
    keep = []
    for tensor in graph.initializer:
        if not uses_external_data(tensor):
            keep.append(tensor)
        elif tensor.name not in inputs:
            graph.input.append(
                onnx.helper.make_tensor_value_info(tensor.name, tensor.data_type, tensor.dims)
            )
    del graph.initializer[:]
    graph.initializer.extend(keep)
    return copy


def ort_load_error(path: Path) -> str | None:
    """onnxruntime's first line when it cannot open `path` (graph optimizations off), else None."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001 - onnxruntime raises its own Fail/InvalidGraph types
        text = re.sub(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ", "", str(e).strip())
        text = re.sub(r"^Load model from .*? failed:", "", text).strip()
        return text.splitlines()[0][:300] if text else type(e).__name__
    return None


def repair_proto(proto: Any) -> list[str]:
    """Repair in place what onnx's checker refuses and onnxruntime ignores; one note per repair.

    - `value_info` entries without a type are hints with nothing in them: dropped;
    - graph outputs without a type get the type onnx's shape inference gives them;
    - shape annotations that onnx's shape inference contradicts (stale after an edit) are
      dropped, so the passes re-infer them instead of trusting wrong numbers;
    - a name defined by more than one Constant node or initializer keeps the definition
      onnxruntime uses (see `_dedupe_constants`).
    """
    import onnx

    notes: list[str] = _dedupe_constants(proto)
    graph = proto.graph
    typeless = [vi for vi in graph.value_info if not vi.type.HasField("tensor_type")]
    typeless = [vi for vi in typeless if not vi.type.WhichOneof("value")]
    if typeless:
        keep = [vi for vi in graph.value_info if vi.type.WhichOneof("value")]
        del graph.value_info[:]
        graph.value_info.extend(keep)
        notes.append(f"dropped {len(typeless)} value_info entries without a type")
    try:
        onnx.shape_inference.infer_shapes(_without_weights(proto), strict_mode=True)
    except Exception as e:  # noqa: BLE001 - InferenceError; only contradictions are repaired
        text = str(e)
        if "existing" in text or "differ" in text:
            stale = len(graph.value_info)
            del graph.value_info[:]
            for out in graph.output:
                if out.type.HasField("tensor_type"):
                    out.type.tensor_type.ClearField("shape")
            notes.append(
                f"dropped {stale} stale shape annotations (onnx's shape inference contradicts "
                "them); shapes are re-inferred"
            )
    return notes


def _dedupe_constants(proto: Any) -> list[str]:
    """Keep one definition of each name that Constant nodes and initializers define twice.

    Why: onnxruntime turns Constant nodes into initializers when it loads a graph, and when a
    name is defined again it keeps the last one ("Duplicate initializer ... the model will use
    the latest encountered initializer"): Constant nodes in node order win over initializers.
    Hand-edited files carry such duplicates (onnxruntime's tiny GPT-2 test models append a
    resized Constant beside the old one), and the IR library refuses a value declared twice.
    The winner becomes the only definition: an initializer, or the last Constant node; a graph
    input of that name stays an input whose default is the winner (as onnxruntime reads it).
    """
    import onnx

    graph = proto.graph
    consts = [
        n
        for n in graph.node
        if n.op_type == "Constant" and n.domain in ("", "ai.onnx") and len(n.output) == 1
    ]
    const_ids = {id(n) for n in consts}
    defined_by_nodes = {o for n in graph.node if id(n) not in const_ids for o in n.output}
    count: dict[str, int] = {}
    for name in [t.name for t in graph.initializer] + [n.output[0] for n in consts]:
        count[name] = count.get(name, 0) + 1
    inputs = {i.name for i in graph.input}
    shadowed = {n.output[0] for n in consts} & inputs  # a Constant over a graph input
    # a name another node defines too: onnxruntime refuses that graph, and so do we
    dup = {name for name in count if count[name] > 1 or name in shadowed} - defined_by_nodes
    for name in dup:
        nodes = [n for n in consts if n.output[0] == name]
        value = (
            next((a.t for a in nodes[-1].attribute if a.name == "value"), None) if nodes else None
        )
        if nodes and value is None:  # value_float, value_ints, ...: the last node stays
            drop, winner = nodes[:-1], None
        else:
            drop = nodes
            winner = onnx.TensorProto()
            winner.CopyFrom(
                value if value is not None else [t for t in graph.initializer if t.name == name][-1]
            )
            winner.name = name
        for n in drop:
            graph.node.remove(n)
        kept = [t for t in graph.initializer if t.name != name]
        del graph.initializer[:]
        graph.initializer.extend([*kept, *([winner] if winner is not None else [])])
    if not dup:
        return []
    return [
        f"kept onnxruntime's definition of {len(dup)} names defined more than once by Constant "
        f"nodes and initializers ({', '.join(sorted(dup)[:3])}{', ...' if len(dup) > 3 else ''})"
    ]


def _inferred(proto: Any) -> dict[str, Any]:
    """name -> inferred ValueInfoProto: onnxruntime's symbolic inference (it follows the mask
    arithmetic of TorchScript exports), else onnx's."""
    import onnx

    try:
        from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

        inferred = SymbolicShapeInference.infer_shapes(
            _without_weights(proto), auto_merge=True, guess_output_rank=True
        )
    except Exception as e:  # noqa: BLE001 - keep onnx's answers
        logger.info("symbolic shape inference failed: %s", _first_line(e))
        inferred = onnx.shape_inference.infer_shapes(_without_weights(proto))
    graph = inferred.graph
    return {vi.name: vi for vi in [*graph.value_info, *graph.input, *graph.output]}


def _type_outputs(proto: Any) -> list[str]:
    """Graph outputs without a type get the inferred one (onnx's checker wants it)."""
    untyped = [
        o
        for o in proto.graph.output
        if not o.type.WhichOneof("value")
        or (o.type.HasField("tensor_type") and not o.type.tensor_type.HasField("shape"))
    ]
    if not untyped:
        return []
    known = _inferred(proto)
    filled = 0
    for out in untyped:
        vi = known.get(out.name)
        if vi is not None and vi.type.tensor_type.HasField("shape"):
            out.type.CopyFrom(vi.type)
            filled += 1
    return [
        f"typed {filled} of {len(untyped)} graph outputs without a type or shape (from shape inference)"
    ]


UPGRADE_BELOW = 13  # opset 13 moved Split/Squeeze/Unsqueeze/Reduce* axes into inputs


def upgrade_opset(proto: Any) -> tuple[Any, list[str]]:
    """Below opset 13, upgrade with onnx's version converter (weights stay references): the
    fusion passes' own converter handles 14+ but leaves some older axes attributes behind."""
    import onnx

    opset = {o.domain: o.version for o in proto.opset_import}.get("", 0)
    if not 0 < opset < UPGRADE_BELOW:
        return proto, []
    try:
        upgraded = onnx.version_converter.convert_version(proto, UPGRADE_BELOW)
    except Exception as e:  # noqa: BLE001 - the passes' converter gets its own try
        return proto, [f"opset {opset} could not be upgraded by onnx ({_first_line(e)})"]
    _unflatten_softmax(upgraded)
    return upgraded, [f"upgraded opset {opset} -> {UPGRADE_BELOW} (onnx's version converter)"]


def _unflatten_softmax(proto: Any) -> int:
    """Undo the converter's Reshape(Softmax(Flatten(x, axis=a)), Shape(x)) where a is x's last
    axis (a last-axis softmax before opset 13): plain Softmax(x, axis=-1), which attention
    fusion recognises. Returns how many were undone."""

    graph = proto.graph
    rank = {
        name: len(vi.type.tensor_type.shape.dim)
        for name, vi in _inferred(proto).items()
        if vi.type.tensor_type.HasField("shape")
    }
    producer = {o: n for n in graph.node for o in n.output}
    consumers: dict[str, list[Any]] = {}
    for n in graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    outputs = {o.name for o in graph.output}
    dead, undone = [], 0
    for node in graph.node:
        if node.op_type != "Softmax" or node.domain not in ("", "ai.onnx"):
            continue
        flat = producer.get(node.input[0])
        uses = consumers.get(node.output[0], [])
        if flat is None or flat.op_type != "Flatten" or len(uses) != 1 or node.output[0] in outputs:
            continue
        back = uses[0]
        shape = producer.get(back.input[1]) if back.op_type == "Reshape" else None
        x = flat.input[0]
        axis = next((a.i for a in flat.attribute if a.name == "axis"), 1)
        if shape is None or shape.op_type != "Shape" or shape.input[0] != x:
            continue
        if rank.get(x) != axis + 1 or len(consumers.get(flat.output[0], [])) != 1:
            continue
        node.input[0] = x
        del node.output[:]
        node.output.append(back.output[0])  # the Reshape's output, so consumers stay as they are
        for a in node.attribute:
            if a.name == "axis":
                a.i = -1
        dead += [flat, back]
        undone += 1
    for n in dead:
        graph.node.remove(n)
    return undone


def load_repaired_ir(path: str | os.PathLike[str], proto: Any) -> Any:
    """The onnx_ir model of `proto` (from `load_onnx_input`) with `path`'s external weights
    left on disk as references, as `onnx_ir.load` would give them."""
    import onnx_ir as ir

    if proto.graph.sparse_initializer:
        raise InvalidModelError(
            f"{path} has sparse initializers ({proto.graph.sparse_initializer[0].values.name}, "
            "...), which the graph library specport rewrites with cannot read; save the model "
            "with dense weights."
        )
    try:
        model = ir.serde.deserialize_model(proto)
    except Exception as e:  # noqa: BLE001 - SerdeError wraps the reason several levels down
        raise InvalidModelError(
            f"{path}'s graph cannot be read ({_innermost(e)}); onnxruntime loads it, but the "
            "graph library specport rewrites with does not. Re-export the model, or report the "
            "file's origin."
        ) from None
    ir.external_data.set_base_dir(model.graph, Path(path).resolve().parent)
    return model


def _innermost(e: BaseException) -> str:
    """The first line of the deepest cause of `e` (onnx_ir's SerdeError names only the graph)."""
    while e.__cause__ is not None:
        e = e.__cause__
    return _first_line(e)[:240]


def _check_output(path: Path) -> None:
    import onnx

    try:
        onnx.checker.check_model(str(path))
    except Exception as e:  # noqa: BLE001
        raise InvalidModelError(
            f"the optimized graph fails onnx's checker ({_first_line(e)}); the input's ops "
            f"could not all be upgraded. Nothing was written. Re-export the model with a "
            f"recent opset, or run fewer passes ({option('passes')})."
        ) from None


def _all_tensors(proto: Any) -> list[Any]:
    try:
        from onnx.external_data_helper import _get_all_tensors

        return list(_get_all_tensors(proto))
    except ImportError:  # pragma: no cover - older onnx
        return list(proto.graph.initializer)


def save_onnx_atomic(
    model: Any, out: Path, mark: str, check: Callable[[Path], None] | None = None
) -> Path:
    """Write `model` (onnx_ir) to `out` + `out.data` in two renames; nothing on failure.

    `check(path)` runs on the written temp copy before the renames (the numeric check of
    `specport optimize`); without one, onnx's checker judges the output.
    """
    import onnx_ir as ir

    out = Path(out).resolve()
    data = onnx_data_path(out)
    model.metadata_props[OPTIMIZED_MARK] = mark
    made = [p for p in [out.parent, *out.parent.parents] if not p.exists()]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp: Path | None = None
    done = False
    try:  # made inside the try: a SIGTERM raised just after mkdtemp still removes it
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        ir.save(model, str(tmp / out.name), external_data=data.name)
        if check is not None:
            check(tmp / out.name)
        else:
            _check_output(tmp / out.name)
        if (tmp / data.name).exists():
            os.replace(tmp / data.name, data)
        os.replace(tmp / out.name, out)
        done = True
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if not done:
            for d in made:  # the folders made for the output, innermost first
                try:
                    d.rmdir()
                except OSError:
                    break
    return out
