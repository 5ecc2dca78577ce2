"""Is the optimized graph the same function as the input? onnxruntime runs both on random
inputs of the input model's own shapes, and the outputs are compared.

Why: `specport optimize` takes graphs other tools exported, with blemishes it repairs and
patterns it rewrites; onnxruntime running the *input file* is the reference a user trusts, so
a rewrite that changes the numbers is refused before the output is renamed into place.

Inputs are made from names and ranks, the way exported decoders spell them: token ids
([B, S], below the embedding's row count), position ids, an all-ones attention mask ([B, T]),
past key/values ([B, H, P, Dh] or stacked [2, B, H, P, Dh]), other inputs [B, S, ...]. Each
symbolic dim name gets one value shared by every input that names it (from those places, else
from the name: batch, past, total or `a + b`, sequence; else S), and the report lists the values
used. A case the *input* model itself cannot run is dropped; when no case runs, the check is
reported as not done, with onnxruntime's reason.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from specport.core.errors import InvalidModelError
from specport.core.onnx_file import ort_load_error

logger = logging.getLogger(__name__)

# (batch, new tokens, past tokens): a decode step with a cache, then a prefill from nothing
CASES = [(2, 3, 4), (1, 4, 0)]
TOLERANCE = {"float": 1e-3, "float16": 3e-2, "bfloat16": 5e-2, "double": 1e-6}


@dataclass(frozen=True)
class Case:
    batch: int
    seq: int
    past: int

    has_past: bool = True

    def label(self, dims: dict[str, int] | None = None) -> str:
        """`B=2, S=3, past 4`, then the value each symbolic dim of the inputs was given."""
        past = f", past {self.past}" if self.has_past else ""
        named = ", ".join(f"{k}={v}" for k, v in (dims or {}).items())
        return f"B={self.batch}, S={self.seq}{past}" + (f" [{named}]" if named else "")


def _session(path: Path) -> Any:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _np_dtype(ort_type: str) -> Any:
    name = ort_type.removeprefix("tensor(").removesuffix(")")
    return {
        "float": np.float32,
        "float16": np.float16,
        "double": np.float64,
        "int64": np.int64,
        "int32": np.int32,
        "int8": np.int8,
        "uint8": np.uint8,
        "bool": np.bool_,
    }.get(name)


def _role(name: str) -> str:
    n = name.lower()
    if "past" in n or "cache" in n:
        return "past"
    if "mask" in n:
        return "mask"
    if "position" in n:
        return "positions"
    if "ids" in n or n in ("input", "tokens"):
        return "ids"
    return "other"


def _dim_by_name(symbol: str, case: Case, total: int) -> int | None:
    s = symbol.lower()
    if "+" in s or "total" in s or "all" in s or "kv" in s:  # "past_sequence_length + ..."
        return total
    if "batch" in s:
        return case.batch
    if "past" in s:
        return case.past
    if "seq" in s or "len" in s or "token" in s:
        return case.seq
    return None


def _by_place(inp: Any, case: Case, total: int) -> dict[int, int]:
    """Dims known from an input's role and rank: ids / positions [B, S], mask [B, T] or
    [B, 1, S, T], past [B, H, P, Dh] or stacked [2, B, H, P, Dh], others [B, S, ...]."""
    role, rank = _role(inp.name), len(inp.shape)
    if role == "past":
        lead = 1 if rank == 5 else 0
        return {lead: case.batch, lead + 2: case.past}
    if role == "mask" and rank == 2:
        return {0: case.batch, 1: total}
    if role == "mask" and rank == 4:
        return {0: case.batch, 2: case.seq, 3: total}
    if rank >= 2:  # ids, positions, hidden states: [B, S, ...]
        return {0: case.batch, 1: case.seq}
    return {}


def input_dims(inputs: list[Any], case: Case, has_past: bool) -> dict[str, int]:
    """One value per symbolic dim name, shared by every input that names it: from the places
    of inputs whose role is known (ids, mask, past), then from the name, else S.

    Why: a dim such as `sequence_length` appears in several inputs, and random inputs that
    disagree on it make the *input* model fail, so nothing would be checked."""
    total = case.past + case.seq if has_past else case.seq
    known: dict[str, int] = {}
    for roles in (("ids", "positions", "mask", "past"), ("other",)):
        for inp in inputs:
            if _role(inp.name) not in roles:
                continue
            for i, guess in _by_place(inp, case, total).items():
                d = inp.shape[i] if i < len(inp.shape) else None
                if isinstance(d, str) and d not in known:
                    known[d] = guess
    for inp in inputs:
        for d in inp.shape:
            if isinstance(d, str) and d not in known:
                named = _dim_by_name(d, case, total)
                known[d] = case.seq if named is None else named
    return known


def _shape(inp: Any, case: Case, has_past: bool, known: dict[str, int]) -> list[int]:
    """Concrete dims for one input: its static dims, the shared value of each named symbolic
    dim, and for an unnamed one the value its place implies (else S)."""
    total = case.past + case.seq if has_past else case.seq
    place = _by_place(inp, case, total)
    dims: list[int] = []
    for i, d in enumerate(inp.shape):
        if isinstance(d, int) and d >= 0:
            dims.append(d)
        elif isinstance(d, str) and d in known:
            dims.append(known[d])
        else:
            dims.append(place.get(i, case.seq))
    return dims


def _vocab(proto: Any, ids_name: str) -> int:
    """Rows of the embedding table that `ids_name` indexes (2 when it cannot be found)."""
    sizes = {t.name: list(t.dims) for t in proto.graph.initializer}
    for node in proto.graph.node:
        if node.op_type == "Gather" and len(node.input) > 1 and node.input[1] == ids_name:
            dims = sizes.get(node.input[0])
            if dims:
                return int(dims[0])
    return 2


def make_feeds(
    sess: Any, proto: Any, case: Case, seed: int = 0
) -> tuple[dict[str, np.ndarray], dict[str, int]] | None:
    """Random feeds for `sess`'s inputs at `case` and the value given to each symbolic dim,
    or None when an input has a type random data cannot be made of."""
    rng = np.random.default_rng(seed)
    inputs = sess.get_inputs()
    has_past = any(_role(i.name) == "past" for i in inputs)
    known = input_dims(inputs, case, has_past)
    feeds: dict[str, np.ndarray] = {}
    for inp in inputs:
        dtype, dims = _np_dtype(inp.type), _shape(inp, case, has_past, known)
        if dtype is None:
            return None
        role = _role(inp.name)
        if dtype is np.bool_ or role == "mask":  # a float 0/1 mask too: noise is no mask
            feeds[inp.name] = np.ones(dims, dtype)
        elif np.issubdtype(dtype, np.floating):
            feeds[inp.name] = rng.standard_normal(dims).astype(dtype)
        elif role == "positions":
            pos = np.arange(case.past, case.past + dims[-1], dtype=dtype)
            feeds[inp.name] = np.broadcast_to(pos, dims).copy()
        else:
            feeds[inp.name] = rng.integers(0, _vocab(proto, inp.name), dims).astype(dtype)
    return feeds, known


def _worst(want: np.ndarray, got: np.ndarray) -> tuple[float, float]:
    """(max |difference| over finite reference values, the reference's scale)."""
    want64, got64 = want.astype(np.float64), got.astype(np.float64)
    finite = np.isfinite(want64)
    if not finite.any():
        return 0.0, 1.0
    diff = np.abs(np.where(finite, want64 - got64, 0.0))
    diff[finite & ~np.isfinite(got64)] = np.inf
    return float(diff.max()), max(1.0, float(np.abs(want64[finite]).max()))


def check_parity(src: Path, out: Path, proto: Any) -> dict[str, Any]:
    """Run `src` and `out` on the same random feeds; raise when an output differs.

    Returns a plain report (`checked`, `cases`, `max_abs_error`, or `reason` when not done).
    """
    try:
        ref = _session(src)
    except Exception as e:  # noqa: BLE001 - judged earlier; a late failure skips the check
        return {"checked": False, "reason": f"onnxruntime cannot open the input: {e}"[:200]}
    cases, expected, skipped = [], [], []
    has_past = any(_role(i.name) == "past" for i in ref.get_inputs())
    for b, s, p in CASES if has_past else [(2, 3, 0)]:
        case = Case(b, s, p, has_past)
        made = make_feeds(ref, proto, case)
        if made is None:
            continue
        feeds, known = made
        try:
            outs = ref.run(None, feeds)
        except Exception as e:  # noqa: BLE001 - a guess the model does not accept
            text = str(e).replace("[ONNXRuntimeError] : ", "").strip().splitlines()[0][:160]
            skipped.append(f"{case.label(known)}: {text}")
            logger.info("parity case skipped: %s", skipped[-1])
            continue
        cases.append((case, feeds, known))
        expected.append(dict(zip([o.name for o in ref.get_outputs()], outs)))
    ref_inputs = {i.name for i in ref.get_inputs()}
    del ref

    why = ort_load_error(out)
    if why is not None:
        raise InvalidModelError(
            f"the optimized graph does not load in onnxruntime ({why}); the input's ops could "
            "not all be upgraded or lowered. Nothing was written."
        )
    if not cases:
        return {
            "checked": False,
            "reason": "no random inputs of the model's shapes ran on the input model"
            + (f" ({skipped[0]})" if skipped else ""),
        }
    opt = _session(out)
    opt_inputs = {i.name for i in opt.get_inputs()}
    if opt_inputs != ref_inputs:
        return {
            "checked": False,
            "reason": "the optimized graph takes other inputs (a new KV layout); compare with "
            "`specport generate` instead",
        }
    names = [o.name for o in opt.get_outputs()]
    worst, report_cases = 0.0, []
    for (case, feeds, known), want in zip(cases, expected):
        try:
            got = dict(zip(names, opt.run(None, feeds)))
        except Exception as e:  # noqa: BLE001 - a rewrite onnxruntime cannot run
            text = str(e).replace("[ONNXRuntimeError] : ", "").strip().splitlines()[0][:240]
            raise InvalidModelError(
                f"the optimized graph fails in onnxruntime on random inputs ({case.label()}: "
                f"{text}) where the input runs; nothing was written. Run fewer passes "
                "(--passes)."
            ) from None
        for name, ref_value in want.items():
            if name not in got:
                raise InvalidModelError(
                    f"the optimized graph lost the output {name}; nothing was written."
                )
            value = got[name]
            if ref_value.shape != value.shape:
                raise InvalidModelError(
                    f"the optimized graph's output {name} has shape {list(value.shape)}, the "
                    f"input's {list(ref_value.shape)} ({case.label()}); nothing was written."
                )
            if not np.issubdtype(ref_value.dtype, np.floating):
                err, scale, tol = float(np.abs(ref_value - value).max(initial=0)), 1.0, 0.0
            else:
                err, scale = _worst(ref_value, value)
                tol = TOLERANCE.get(str(ref_value.dtype).replace("float32", "float"), 1e-3)
            if err > tol * scale:
                raise InvalidModelError(
                    f"the optimized graph's output {name} differs from onnxruntime running the "
                    f"input by {err:.3g} (allowed {tol * scale:.3g}) on random inputs "
                    f"({case.label()}); nothing was written. Run fewer passes (--passes)."
                )
            worst = max(worst, err)
        report_cases.append(case.label(known))
    return {"checked": True, "cases": report_cases, "max_abs_error": worst}
