"""`--bits-per-weight B` / `--mixture NAME`: per-tensor widths and block sizes under a size budget.

The k-quant idea done with the kernels onnxruntime has. llama.cpp's mixtures (Q4_K_M keeps
some tensors at 6 bits) are hand-written rules; here every tensor's options are measured. Each
weight, the LM head and the embedding table included, gets the (bits, block) options its kernel
runs fast (MatMulNBits with int8 activations: 4 or 8 bits, blocks 32/64/128; float activations:
4 bits only, its 8-bit path is ~50x slower on CPU; the gathered table: 4 or 8 bits), each
costed in the bytes it stores (codes, float32 scales, zero points: `nbits_bytes`) and scored by
the relative output error it causes on the calibration inputs,
trace(dW^T H dW) / trace(W^T H W) with H the layer's input Gram matrix (weight-space error for
the table and without calibration text). Options that cost more and err more are dropped. A
tied embedding is planned as one tensor with its head: the table gathers from the head's
codes (embedding.py), so the matrix is stored once, as in llama.cpp's file.

Allocation is the greedy solution of the multiple-choice knapsack: start every tensor at its
smallest option, then repeatedly take the upgrade with the largest error decrease per byte
that still fits, until nothing fits. The LM head's error weighs `HEAD_WEIGHT` times a body
weight's (measured, see there). The budget is the whole file, `B x parameters / 8` bytes:
what stays float (norms) is charged first, and a budget below the smallest file the kernels
can store is refused with that floor in the message.

The options are scored with RTN (cheap, and the ordering of options is what matters); the
chosen widths are then quantized with the run's algorithm (GPTQ with `--calib`), so the
errors the pass reports are lower than the planner's.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx_ir as ir

from specport.core.errors import QuantizationError
from specport.core.options import option
from specport.passes.quant.blockquant import dequantize
from specport.passes.quant.calibration import ActStats
from specport.passes.quant.embedding import gather_tables
from specport.passes.quant.graph import find_weight_matmuls
from specport.passes.quant.head import nbits_bytes
from specport.passes.quant.head_rows import (
    measure_head_rows,
    row_errors,
    split_points,
    token_frequencies,
)
from specport.passes.quant.rtn import quantize_rtn
from specport.passes.quant.sensitivity import MEASURE_BITS, MEASURE_GROUP, loss_factors

logger = logging.getLogger(__name__)

# Nominal bits per weight of llama.cpp's types (block formats with fp16 scales: Q4_0 18 bytes
# per 32 weights; Q4_K_M as llama.cpp reports it on Llama-class 7B models). On a small model
# with a large tied vocabulary these are far below what llama.cpp's own file reaches (its
# SmolLM2-135M Q4_K_M is 6.17 bits: K=576 is not a multiple of its 256-weight super-blocks).
MIXTURES = {"q4_0": 4.5, "q4_k_m": 4.85, "q5_k_m": 5.7, "q6_k": 6.5625, "q8_0": 8.5}
GROUPS = (32, 64, 128)
# The LM head's relative error counts this many times a body weight's: its error lands on the
# logits directly, a body weight's is diluted by the residual stream. Measured on stories260K
# (W4A8, last 300 documents): weight 1 left the head at 4 bits and cost +5.55% at 6.0 bits and
# +3.35% at 7.0; weight 20 buys the 8-bit head at both (+4.09%, +2.41%), 5 lands between
# (+4.64% at 6.0), and at 5.0 bits all keep it at 4 (+7.99%). On SmolLM2-135M an unweighted
# plan at 6.17 bits kept the head at 4 bits and lost 22% on unseen prose.
HEAD_WEIGHT = 20.0


@dataclass
class Option:
    bits: int
    group: int
    nbytes: int
    error: float
    float_zero: bool = False  # 4-bit min/max RTN with float32 zero points (Q4_1's grid)
    frequent_rows: int = 0  # a tied head split by vocabulary: its first rows ...
    frequent_group: int = 0  # ... at 8 bits in blocks of this size (head_rows.py)


@dataclass
class Tensor:
    name: str
    kind: str  # "matmul", "head" or "table"
    params: int
    options: list[Option]
    choice: int = 0

    @property
    def chosen(self) -> Option:
        return self.options[self.choice]


@dataclass
class BudgetPlan:
    """Site name -> bits / block for the weight pass; the table's (bits, block) or None."""

    bits: dict[str, int] = field(default_factory=dict)
    groups: dict[str, int] = field(default_factory=dict)
    float_zero: set[str] = field(default_factory=set)  # sites with float zero points
    table: tuple[int, int] | None = None
    shared: bool = False  # the table gathers from the tied head's codes
    # The tied head's site and its first rows kept 8-bit (0: whole); `assign_split` moves its
    # widths onto the two heads once the graph is split (vocab_split.py).
    head_site: str = ""
    frequent_rows: int = 0
    frequent_group: int = 0

    def assign_split(self, model: ir.Model, frequent: str, rare: str) -> None:
        """After the split: the frequent head's weight `frequent` at 8 bits, the rare one's
        `rare` at the head's planned width, in place of the whole head's site."""
        bits, group = self.bits.pop(self.head_site), self.groups.pop(self.head_site)
        for site in find_weight_matmuls(model):
            if site.weight.name == frequent:
                self.bits[site.name], self.groups[site.name] = 8, self.frequent_group
            elif site.weight.name == rare:
                self.bits[site.name], self.groups[site.name] = bits, group


def resolve_budget(bits_per_weight: float | None, mixture: str | None) -> float | None:
    """The target in bits per weight from `--bits-per-weight` or a named `--mixture`."""
    if mixture is not None:
        if bits_per_weight is not None:
            raise QuantizationError(
                f"pass {option('bits_per_weight')} or {option('mixture')}, not both"
            )
        if mixture.lower() not in MIXTURES:
            raise QuantizationError(
                f"unknown mixture {mixture!r}; choose one of {', '.join(MIXTURES)} "
                f"(or a size with {option('bits_per_weight')})"
            )
        return MIXTURES[mixture.lower()]
    if bits_per_weight is not None and not 2.0 < bits_per_weight <= 16.0:
        raise QuantizationError(
            f"{option('bits_per_weight')} must be between 2 and 16, got {bits_per_weight}"
        )
    return bits_per_weight


def _rel_errors(w: np.ndarray, h: np.ndarray | None, hats: list[np.ndarray]) -> list[float]:
    """trace(dW^T H dW) / trace(W^T H W) for each w_hat (weight-space without H); w [K, N]."""
    nums, den = row_errors(w, h, hats)
    total = max(float(den.sum()), 1e-30)
    return [float(num.sum() / total) for num in nums]


def _pareto(options: list[Option]) -> list[Option]:
    """Options by size, each strictly better than every smaller one."""
    kept: list[Option] = []
    for o in sorted(options, key=lambda o: (o.nbytes, o.error)):
        if not kept or o.error < kept[-1].error:
            kept.append(o)
    return kept


def _apply_loss(
    tensors: list[Tensor], loss: tuple[dict[str, str], dict[str, dict[str, Any]]]
) -> dict[str, float]:
    """Scale every tensor's option errors by its group's loss factor (sensitivity.py); a
    tensor without a measured group keeps its relative error."""
    keys, group_kl = loss
    at_measured = {
        t.name: o.error
        for t in tensors
        for o in t.options
        # the option the group's KL was measured at: integer zero points, the tensor whole
        if (o.bits, o.group, o.float_zero, o.frequent_rows)
        == (MEASURE_BITS, MEASURE_GROUP, False, 0)
    }
    factors = loss_factors(keys, group_kl, at_measured)
    for t in tensors:
        f = factors.get(t.name)
        if f is not None:
            t.options = [dataclasses.replace(o, error=o.error * f) for o in t.options]
    return factors


def table_bytes(v: int, d: int, bits: int, group: int) -> int:
    """GatherBlockQuantized bytes of a [V, D] table: codes, float32 scales, packed zero points."""
    blocks = d // group
    return v * d * bits // 8 + v * blocks * 4 + v * (-(-blocks * bits // 8))


def _measure_matmul(
    w: np.ndarray,
    st: ActStats | None,
    widths: tuple[int, ...],
    symmetric: bool,
    float_zero: bool = False,
) -> list[Option]:
    """Every (bits, block[, float zero]) option of one weight w [K, N], RTN-measured.
    `float_zero`: 4-bit options with float32 zero points too (asymmetric only)."""
    k, n = w.shape
    combos = [(b, g, False) for b in widths for g in GROUPS]
    if float_zero and not symmetric and 4 in widths:
        combos += [(4, g, True) for g in GROUPS]
    hats = [dequantize(quantize_rtn(w, b, g, symmetric, float_zero=f)) for b, g, f in combos]
    errs = _rel_errors(w, None if st is None else st.hessian, hats)
    return [
        Option(b, g, nbits_bytes(k, n, b, g, not symmetric, f), e, f)
        for (b, g, f), e in zip(combos, errs)
    ]


def _split_head_options(
    w: np.ndarray,
    st: ActStats | None,
    widths: tuple[int, ...],
    symmetric: bool,
    token_ids: np.ndarray | None,
    head_weight: float,
    split_rows: int | None = None,
) -> list[Option]:
    """A tied head w [K, V] whole at each (bits, block), and split after each candidate row
    count with the first rows 8-bit: errors weighted by token frequency (head_rows.py),
    bytes of both heads (the table gathers from their codes). `split_rows`: the user's row
    count, the only split offered, and the head is not kept whole."""
    k, v = w.shape
    combos = [(b, g) for b in widths for g in GROUPS if k % g == 0]
    freq = token_frequencies(v, token_ids)
    rows = measure_head_rows(w, None if st is None else st.hessian, freq, combos, symmetric)
    zp = not symmetric
    opts = [
        Option(b, g, nbits_bytes(k, v, b, g, zp), rows.error(0, (b, g), (b, g), head_weight))
        for b, g in combos
        if split_rows is None
    ]
    if 8 not in widths:
        return opts
    for n in split_points(v) if split_rows is None else [split_rows]:
        for wide in (c for c in combos if c[0] == 8):
            for narrow in (c for c in combos if c[0] < 8):
                opts.append(
                    Option(
                        narrow[0],
                        narrow[1],
                        nbits_bytes(k, n, 8, wide[1], zp) + nbits_bytes(k, v - n, *narrow, zp),
                        rows.error(n, wide, narrow, head_weight),
                        frequent_rows=n,
                        frequent_group=wide[1],
                    )
                )
    return opts


def _measure_table(e: np.ndarray) -> list[Option]:
    v, d = e.shape
    out = []
    for b in (4, 8):
        for g in GROUPS:
            if d % g:
                continue
            hat = dequantize(quantize_rtn(e.T, b, g, symmetric=False))
            (err,) = _rel_errors(e.T, None, [hat])
            out.append(Option(b, g, table_bytes(v, d, b, g), err))
    return out


def plan_bit_budget(
    model: ir.Model,
    stats: Mapping[str, ActStats] | None,
    target_bpw: float,
    params: int,
    float_bytes: int,
    widths: tuple[int, ...] = (4, 8),
    symmetric: bool = False,
    table: bool = True,
    loss: tuple[dict[str, str], dict[str, dict[str, Any]]] | None = None,
    float_zero: bool = False,
    split_head: bool = False,
    split_rows: int | None = None,
    token_ids: np.ndarray | None = None,
) -> tuple[BudgetPlan, dict[str, Any]]:
    """Plan widths for `model` (float) so that its file holds at most `target_bpw` bits per
    parameter. `params`: the model's parameter count; `float_bytes`: bytes of every float
    weight in the source graph (the part not planned stays float). `table`: the embedding
    table is quantized too (GatherBlockQuantized). `loss`: (site -> group, group -> measured
    KL) from sensitivity.measure_group_kl; each tensor's errors are then converted to loss
    with its group's factor, else the head's error is weighted `HEAD_WEIGHT`. `float_zero`:
    4-bit options with float32 zero points compete too (6.0 bits per weight at block 32:
    llama.cpp's Q4_1 grid), except for a tied head, whose table gathers integer codes; they
    are emitted as block offsets (block_offsets.py), which cost SmolLM2 W4A8 1.2x the decode
    CPU of integer zero points per token, hence asked for, not a default.
    `split_head`: a tied head may also be split after its first rows, those at 8 bits, its
    errors weighted by token frequency (head_rows.py; `token_ids`: the calibration tokens);
    the plan's `frequent_rows` says where, 0 for whole. `split_rows`: split after exactly this
    many rows (`--frequent-head-rows N`); the rest of the plan is chosen as usual."""
    tensors: list[Tensor] = []
    planned_elems = 0
    seen: set[str] = set()
    tables = gather_tables(model) if table else []
    table_names = {value.name for _, value in tables}
    for site in find_weight_matmuls(model):
        w = site.weight_array()
        st = (stats or {}).get(site.x.name or "")
        opts = _measure_matmul(w, st, widths, symmetric, float_zero)
        kind = "head" if site.lm_head else "matmul"
        if site.lm_head and loss is None:
            opts = [dataclasses.replace(o, error=o.error * HEAD_WEIGHT) for o in opts]
        tied = site.lm_head and site.transposed and site.weight.name in table_names
        if tied and split_head:
            kind = "head+table"
            weight = HEAD_WEIGHT if loss is None else 1.0
            opts = _split_head_options(w, st, widths, symmetric, token_ids, weight, split_rows)
        elif tied:
            # Tied: the table gathers from the head's codes (embedding.py), so one matrix is
            # stored; its options are the blocks that divide D, its error the head's plus the
            # table's own.
            kind = "head+table"
            table_err = {(o.bits, o.group): o.error for o in _measure_table(w.T)}
            opts = [
                dataclasses.replace(o, error=o.error + table_err[(o.bits, o.group)])
                for o in opts
                if (o.bits, o.group) in table_err and not o.float_zero
            ]
        tensors.append(Tensor(site.name, kind, w.size, opts))
        if site.weight.name not in seen:
            planned_elems += w.size
            seen.add(site.weight.name or site.name)
    for node, value in tables:
        if value.name in seen:  # a tied table, planned with its head
            continue
        e = np.asarray(value.const_value.numpy(), dtype=np.float32)  # type: ignore[union-attr]
        opts = _pareto(_measure_table(e))
        if not opts:
            continue
        tensors.append(Tensor(node.name or "gather", "table", e.size, opts))
        if value.name not in seen:
            planned_elems += e.size
            seen.add(value.name or "")
    factors = _apply_loss(tensors, loss) if loss is not None else {}
    for t in tensors:
        t.options = _pareto(t.options)
    fixed = float_bytes - 4 * planned_elems  # what stays float (norms)
    budget = int(target_bpw * params / 8)
    total = fixed + sum(t.chosen.nbytes for t in tensors)
    floor = 8 * total / params
    if total > budget:
        raise QuantizationError(
            f"{target_bpw} bits per weight is below the smallest file these kernels can store "
            f"for this model ({floor:.2f} bits per weight: float32 block scales, and a tied "
            f"embedding stored as both table and head"
            + (f", its first {split_rows} rows 8-bit as asked" if split_rows else "")
            + f"); ask for at least {floor:.2f}"
        )
    while True:
        best: tuple[float, Tensor, int] | None = None
        for t in tensors:
            cur = t.chosen
            for j in range(t.choice + 1, len(t.options)):
                o = t.options[j]
                extra = o.nbytes - cur.nbytes
                if total + extra > budget:
                    break  # options grow in size
                ratio = (cur.error - o.error) / max(extra, 1)
                if best is None or ratio > best[0]:
                    best = (ratio, t, j)
        if best is None:
            break
        _, t, j = best
        total += t.options[j].nbytes - t.chosen.nbytes
        t.choice = j
    plan = BudgetPlan()
    for t in tensors:
        if t.kind in ("table", "head+table"):
            plan.table = (t.chosen.bits, t.chosen.group)
            plan.shared = t.kind == "head+table"
        if t.chosen.frequent_rows:
            plan.head_site = t.name
            plan.frequent_rows, plan.frequent_group = (
                t.chosen.frequent_rows,
                t.chosen.frequent_group,
            )
        if t.kind != "table":
            plan.bits[t.name], plan.groups[t.name] = t.chosen.bits, t.chosen.group
            if t.chosen.float_zero:
                plan.float_zero.add(t.name)
    counts: dict[str, int] = {}
    for t in tensors:
        key = f"{t.chosen.bits}-bit/{t.chosen.group}" + (
            " float-zero" if t.chosen.float_zero else ""
        )
        if t.chosen.frequent_rows:
            key += f" with its first {t.chosen.frequent_rows} rows 8-bit/{t.chosen.frequent_group}"
        counts[key] = counts.get(key, 0) + 1
    summary = ", ".join(f"{n} at {k}" for k, n in sorted(counts.items()))
    report = {
        "name": "plan_bit_budget",
        "modified": False,
        "target_bits_per_weight": target_bpw,
        "planned_bits_per_weight": round(8 * total / params, 4),
        "floor_bits_per_weight": round(floor, 4),
        "float_bytes_kept": fixed,
        "measured_with": "rtn"
        + (", calibration Gram" if stats else ", weight-space error")
        + (", errors in loss units (KL of 4-bit groups)" if loss is not None else "")
        + (", float zero points offered" if float_zero else ""),
        "loss_groups": None if loss is None else loss[1],
        "summary": summary,
        "tensors": {
            t.name: {
                "kind": t.kind,
                "bits": t.chosen.bits,
                "group_size": t.chosen.group,
                "bytes": t.chosen.nbytes,
                **({"float_zero": True} if t.chosen.float_zero else {}),
                **(
                    {
                        "frequent_rows": t.chosen.frequent_rows,
                        "frequent_bits": 8,
                        "frequent_group_size": t.chosen.frequent_group,
                    }
                    if t.chosen.frequent_rows
                    else {}
                ),
                "error": round(t.chosen.error, 10),
                **({"loss_factor": round(factors[t.name], 6)} if t.name in factors else {}),
            }
            for t in tensors
        },
    }
    logger.info("bit budget %.2f: %s (%.3f planned)", target_bpw, summary, 8 * total / params)
    return plan, report
