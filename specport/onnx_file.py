"""A bare ONNX file in (`specport optimize`) and out: checked first, written atomically.

Checked before any pass runs, each with a one-line message that says what to do: the file is
not ONNX (or truncated), its external weights are missing or short, it fails onnx's checker,
or its opset is newer than this onnx knows. The output is written to a temp folder beside
`--out`, checked again (a graph whose old ops could not be upgraded fails here) and only then
renamed into place, so a failure never leaves a partial file.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from specport.errors import InvalidModelError, UsageError
from specport.options import option
from specport.outputs import OPTIMIZED_MARK, onnx_data_path

logger = logging.getLogger(__name__)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".strip().rstrip(":")


def check_onnx_input(path: str | os.PathLike[str]) -> Any:
    """Read `path`'s graph (weights stay on disk) and check it; returns the ModelProto."""
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
    try:  # by path: external data is looked up beside the file, not in the current folder
        onnx.checker.check_model(str(p))
    except Exception as e:  # noqa: BLE001 - ValidationError and friends
        raise InvalidModelError(
            f"{p} fails onnx's checker ({_first_line(e)}); fix or re-export the model."
        ) from None
    return proto


def _all_tensors(proto: Any) -> list[Any]:
    try:
        from onnx.external_data_helper import _get_all_tensors

        return list(_get_all_tensors(proto))
    except ImportError:  # pragma: no cover - older onnx
        return list(proto.graph.initializer)


def save_onnx_atomic(model: Any, out: Path, mark: str) -> Path:
    """Write `model` (onnx_ir) to `out` + `out.data`, checked, in two renames; nothing on failure."""
    import onnx
    import onnx_ir as ir

    out = Path(out).resolve()
    data = onnx_data_path(out)
    model.metadata_props[OPTIMIZED_MARK] = mark
    made = [p for p in [out.parent, *out.parent.parents] if not p.exists()]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    done = False
    try:
        ir.save(model, str(tmp / out.name), external_data=data.name)
        try:
            onnx.checker.check_model(str(tmp / out.name))
        except Exception as e:  # noqa: BLE001
            raise InvalidModelError(
                f"the optimized graph fails onnx's checker ({_first_line(e)}); the input's ops "
                f"could not all be upgraded. Nothing was written. Re-export the model with a "
                f"recent opset, or run fewer passes ({option('passes')})."
            ) from None
        if (tmp / data.name).exists():
            os.replace(tmp / data.name, data)
        os.replace(tmp / out.name, out)
        done = True
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if not done:
            for d in made:  # the folders made for the output, innermost first
                try:
                    d.rmdir()
                except OSError:
                    break
    return out
