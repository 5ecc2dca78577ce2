"""`--lm-head-bits auto`: choose the LM head's precision from its cost and its measured effect.

Decode is memory-bound, so a weight's cost is the bytes one decoded token reads from it. The
head is a MatMul operand of its own even when the embeddings are tied (MatMul(x, Transpose(E))
is quantized from E^T; the table the Gather reads is a separate initializer), and with a large
vocabulary it is a big share of those bytes: 4 bits halves it.

Its effect is measured where it acts: the head's calibration inputs (the final norm's output,
collected by the calibration pass like every MatMul input) are multiplied by the float weight
and by the weight quantized exactly as the pass would, and we compare the logits: relative
error, top-1 agreement, and the increase of next-token cross-entropy against the float model's
own predictive distribution, KL(p || q) / H(p) (no labels needed; it is the relative perplexity
change under the float model's predictions). Without calibration text only the weight-space
error exists, which does not say what the logits do (hqq's 4-bit head costs SmolLM2-135M
+7.6% perplexity), so auto keeps the wider head then and records that error.

Rule: 4 bits when the head at the wider precision is more than `SHARE_MIN` of the bytes read
per token AND the 4-bit head's cross-entropy increase is under `CE_REL_MAX` AND its top-1
agreement is at least `TOP1_MIN`; otherwise the wider head (8 bits for w4a8, float for w4a16).
Both widths are costed and measured at the block size the pass would emit: an 8-bit head with
int8 activations takes a larger block than the body (`weight_quant.head_group_size`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx_ir as ir

from specport.core.errors import QuantizationError
from specport.core.options import option
from specport.passes.quant.blockquant import BlockQuant, dequantize
from specport.passes.quant.calibration import ActStats
from specport.passes.quant.graph import WeightSite, find_weight_matmuls
from specport.passes.quant.weight_only import QuantizeWeightsNBitsPass
from specport.passes.quant.weight_quant import output_rel_error

logger = logging.getLogger(__name__)

SHARE_MIN = 0.10  # head's share of bytes read per token (at the wider precision)
CE_REL_MAX = 0.005  # relative next-token cross-entropy increase of the 4-bit head
TOP1_MIN = 0.99  # top-1 agreement of the 4-bit head's logits with the float head's
ROWS_PER_CHUNK = 128  # logits rows at a time: 128 x 152k vocab x fp32 = 78 MB per matrix


def head_wide(scheme: str) -> int:
    """The head auto weighs 4 bits against: 8 where activations are int8 anyway (w4a8's
    MatMulNBits accuracy_level 4), float for w4a16 (no fast 8-bit float-activation kernel)."""
    return 8 if scheme in ("w4a8", "w8a8") else 0


def check_head_bits(scheme: str, algo: str, lm_head_bits: int | str | None) -> None:
    """LM head bits are None (the scheme's default), 0, 4, 8, or auto for w4a8/w4a16."""
    if lm_head_bits not in (None, 0, 4, 8, "auto"):
        raise QuantizationError(
            f"{option('lm_head_bits')} must be 0 (float), 4, 8 or auto, got {lm_head_bits!r}"
        )
    if lm_head_bits != "auto":
        return
    if scheme not in ("w4a8", "w4a16"):
        raise QuantizationError(
            f"{option('lm_head_bits', 'auto')} weighs a 4-bit head against w4a8's 8-bit or "
            f"w4a16's float one; for {scheme} pass 0, 4 or 8"
        )
    if algo.startswith("ort-"):
        raise QuantizationError(
            f"{option('lm_head_bits', 'auto')} measures specport's own quantizer; drop it for "
            f"the {algo} baseline"
        )


def nbits_bytes(
    k: int, n: int, bits: int, group_size: int, zero_points: bool = True, float_zero: bool = False
) -> int:
    """Bytes of one weight [K, N] as MatMulNBits stores it (codes, fp32 scales, zero points:
    packed codes, or one float32 per block with `float_zero`); bits 0 or 32: the float32
    weight. 4 bits at block 32 with float zero points is 6.0 bits per weight."""
    if bits not in (4, 8):
        return 4 * k * n
    blocks = -(-k // group_size)
    size = n * blocks * (group_size * bits // 8) + n * blocks * 4
    if float_zero:
        size += n * blocks * 4
    elif zero_points:
        size += n * (-(-blocks // 2) if bits == 4 else blocks)
    return size


def bytes_per_token(
    sites: list[WeightSite],
    bits: int,
    group_size: int,
    head_bits: int,
    plan: Mapping[str, int] | None = None,
    zero_points: bool = True,
    head_group: int | None = None,
) -> tuple[int, int]:
    """(all MatMul weight bytes one decoded token reads, of which the LM head's); the head's
    block size is `head_group` (None: `group_size`)."""
    total = head = 0
    for s in sites:
        b = head_bits if s.lm_head else (plan or {}).get(s.name, bits)
        g = head_group if s.lm_head and head_group is not None else group_size
        size = nbits_bytes(s.k, s.n, b, g, zero_points)
        total += size
        head += size if s.lm_head else 0
    return total, head


def logit_effect(w: np.ndarray, w_hat: np.ndarray, x: np.ndarray) -> dict[str, float]:
    """Float vs quantized head on inputs x [R, K]: relative logit error, top-1 agreement and
    the relative next-token cross-entropy increase KL(p || q) / H(p), p the float head's."""
    num = den = kl = ent = 0.0
    agree = 0
    for a in range(0, x.shape[0], ROWS_PER_CHUNK):
        xc = x[a : a + ROWS_PER_CHUNK].astype(np.float32)
        lf, lq = xc @ w, xc @ w_hat
        num += float(((lq - lf).astype(np.float64) ** 2).sum())
        den += float((lf.astype(np.float64) ** 2).sum())
        agree += int((lf.argmax(1) == lq.argmax(1)).sum())
        lpf = lf - lf.max(1, keepdims=True)
        lpf -= np.log(np.exp(lpf).sum(1, keepdims=True))
        lpq = lq - lq.max(1, keepdims=True)
        lpq -= np.log(np.exp(lpq).sum(1, keepdims=True))
        p = np.exp(lpf)
        kl += float((p * (lpf - lpq)).sum(dtype=np.float64))
        ent += float(-(p * lpf).sum(dtype=np.float64))
    rows = max(x.shape[0], 1)
    return {
        "rows": int(x.shape[0]),
        "rel_logit_error": round(float(np.sqrt(num / max(den, 1e-30))), 6),
        "top1_agreement": round(agree / rows, 6),
        "ce_float": round(ent / rows, 6),
        "ce_rel_increase": round(kl / max(ent, 1e-30), 6),
        "ppl_rel_increase": round(float(np.expm1(kl / rows)), 6),
    }


def choose_lm_head_bits(
    model: ir.Model,
    stats: Mapping[str, ActStats] | None,
    quantizer: QuantizeWeightsNBitsPass,
    wide: int,
) -> tuple[int, dict[str, Any]]:
    """(head bits, report): 4 or `wide` (8, or 0 for a float head) by the rule in the module
    docstring. `quantizer` is the weight pass as configured (algorithm, group, plan, ...)."""
    sites = find_weight_matmuls(model)
    heads = [s for s in sites if s.lm_head]
    report: dict[str, Any] = {"name": "choose_lm_head_bits", "modified": False, "choice": "auto"}
    if not heads:
        report.update(bits=wide, reason="no LM head MatMul found")
        return wide, report
    head = heads[0]
    g, zp = quantizer.group_size, not quantizer.symmetric
    cost: dict[str, Any] = {}
    for b in (4, wide):
        hg = quantizer.group_for(head, b)
        total, hb = bytes_per_token(sites, quantizer.bits, g, b, quantizer.plan, zp, hg)
        cost[str(b or 32)] = {"bytes_per_token": total, "head_bytes": hb, "head_share": hb / total}
    share = cost[str(wide or 32)]["head_share"]
    st = stats.get(head.x.name or "") if stats else None
    w = head.weight_array()
    measured: dict[str, Any] = {}
    kept: dict[int, tuple[dict[str, Any], BlockQuant]] = {}
    for b in (4, wide):
        if not b:
            continue
        quantizer.lm_head_bits = b
        row_q, bq = quantizer._quantize_site(head)
        if bq is None:  # a form without this width (qdq: 4 bits only) keeps the head float
            continue
        w_hat = dequantize(bq)
        row: dict[str, Any] = {"rel_weight_error": round(output_rel_error(w, w_hat, None), 8)}
        if st is not None:
            row.update(logit_effect(w, w_hat, st.rows_sample()))
        measured[str(b)] = row
        kept[b] = (row_q, bq)
        del w_hat
    m4 = measured["4"]
    quantizer.lm_head_bits = wide
    if share <= SHARE_MIN:
        bits, why = wide, f"head is {share:.1%} of bytes per token (<= {SHARE_MIN:.0%})"
    elif st is None:
        bits, why = wide, "no calibration text: the 4-bit head's effect on logits is not measured"
    elif m4["ce_rel_increase"] >= CE_REL_MAX or m4["top1_agreement"] < TOP1_MIN:
        bits = wide
        why = (
            f"4-bit head: cross-entropy +{m4['ce_rel_increase']:.2%} (limit {CE_REL_MAX:.1%}), "
            f"top-1 agreement {m4['top1_agreement']:.2%} (limit {TOP1_MIN:.0%})"
        )
    else:
        bits = 4
        why = (
            f"head is {share:.1%} of bytes per token; 4-bit head: cross-entropy "
            f"+{m4['ce_rel_increase']:.2%}, top-1 agreement {m4['top1_agreement']:.2%}"
        )
    report.update(
        {
            "bits": bits,
            "reason": why,
            "head": head.name,
            "k": head.k,
            "n": head.n,
            "cost": cost,
            "measured": measured,
            "rule": {"share_min": SHARE_MIN, "ce_rel_max": CE_REL_MAX, "top1_min": TOP1_MIN},
        }
    )
    if bits in kept:  # the pass emits this weight instead of quantizing the head again
        quantizer.prequantized[head.name] = kept[bits]
    logger.info("LM head: %s bits (%s)", bits or "float", why)
    return bits, report
