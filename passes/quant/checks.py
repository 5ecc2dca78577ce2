"""Checks of `quantize_artifact`'s options: scheme, algorithm, form, KV cache, input layout.

They run before any calibration or graph work, so a bad combination fails in a second with a
message naming the option; `specport.preflight` runs the same checks for the CLI (turning them
into usage errors) before it opens anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specport.artifact.manifest import Manifest
from specport.core.errors import QuantizationError
from specport.core.history import entries
from specport.core.options import option
from specport.passes.quant.kv_cache import default_kv_granularity
from specport.passes.quant.kv_calibration import KV_CLIPS, KV_GRANULARITIES
from specport.passes.quant.row_invariance import PORTABLE_ROW_INVARIANT_BLOCK, kernel_row_invariant
from specport.passes.quant.w8a8 import FORMS as W8A8_FORMS
from specport.passes.quant.weight_quant import NEEDS_CALIB

SCHEMES = ("w8a8", "w8a16", "w4a16", "w4a8")


def default_group_size(scheme: str, exact_speculation: bool = False) -> int:
    """32 for the 4-bit and weight-only schemes; 64 for w8a8: 8-bit blocks of 64 are the
    largest whose int8 kernel computes a token the same in a one-token step and a verify run
    (row_invariance.py), and decode as fast as 128 (0.98x CPU per token on SmolLM2).
    w4a8 with `exact_speculation`: the largest 4-bit block up to 32 whose int8 kernel is
    row-invariant on this CPU: 32 on AVX-512 VNNI, 16 on AVX2, where 32 is not (blocks of 16
    decode SmolLM2 1.48x slower there, so they are not forced where 32 is exact; quantize warns
    that such a file is exact only on CPUs like this one)."""
    if scheme == "w4a8" and exact_speculation:
        return 32 if kernel_row_invariant(4, 32) else PORTABLE_ROW_INVARIANT_BLOCK[4]
    return 64 if scheme == "w8a8" else 32


ALGOS = ("rtn", "hqq", "gptq", "clip", "default", "ort-default", "ort-hqq")


def check_kv_options(
    scheme: str,
    algo: str,
    kv_cache: str,
    kv_clip: str,
    calib: Sequence[Any],
    kv_granularity: str | None = None,
    kv_float_layers: Sequence[int] | str = (),
) -> None:
    """The int8 KV cache options, alone and against the weight scheme and calibration text."""
    if kv_float_layers and kv_cache != "int8":
        raise QuantizationError(
            f"{option('kv_float_layers')} applies to {option('kv_cache', 'int8')}"
        )
    if kv_granularity is not None and kv_granularity not in KV_GRANULARITIES:
        raise QuantizationError(
            f"{option('kv_granularity')} must be one of {', '.join(KV_GRANULARITIES)}, "
            f"not {kv_granularity!r}"
        )
    if kv_granularity is not None and kv_cache != "int8":
        raise QuantizationError(
            f"{option('kv_granularity')} applies to {option('kv_cache', 'int8')}; add it or "
            "drop the granularity"
        )
    if kv_cache not in ("float", "int8"):
        raise QuantizationError(f"{option('kv_cache')} must be float or int8, not {kv_cache!r}")
    if kv_clip not in KV_CLIPS:
        raise QuantizationError(
            f"{option('kv_clip')} must be one of {', '.join(KV_CLIPS)}, not {kv_clip!r}"
        )
    if scheme == "none" and kv_cache == "float":
        raise QuantizationError(
            f"nothing to do: pass a weight {option('scheme')} and/or {option('kv_cache', 'int8')}"
        )
    if kv_cache == "int8" and algo.startswith("ort-"):
        raise QuantizationError(
            f"{algo} is a weight-only baseline; drop {option('kv_cache', 'int8')}"
        )
    if kv_cache == "int8" and not calib:
        raise QuantizationError(
            f"{option('kv_cache', 'int8')} needs calibration text for its scales; "
            f"pass {option('calib_files')} (documents separated by blank lines)"
        )


def check_weight_options(
    scheme: str, algo: str, group_size: int, calib_files: Sequence[Any], mixed: str, form: str
) -> None:
    """The weight scheme, algorithm, group size, form and mixed precision, and whether they
    need calibration text."""
    forms = W8A8_FORMS if scheme == "w8a8" else ("matmulnbits", "qdq")
    if scheme in ("w8a16", "w4a16"):
        forms = (*forms, "npu")  # QDQ with uint16 activations (passes/quant/npu.py)
    if form not in forms:
        raise QuantizationError(
            f"{option('form', form)} is not a {scheme} form; choose {', '.join(forms)}"
        )
    if scheme == "none":
        if mixed == "auto":
            raise QuantizationError(
                f"{option('mixed_precision', 'auto')} needs a weight {option('scheme')}"
            )
        return
    if scheme not in SCHEMES:
        raise QuantizationError(f"unknown scheme {scheme!r}; choose one of {', '.join(SCHEMES)}")
    if algo not in ALGOS:
        raise QuantizationError(f"unknown algorithm {algo!r}; choose one of {', '.join(ALGOS)}")
    if group_size not in (16, 32, 64, 128, 256):
        raise QuantizationError(f"group size {group_size} is not supported; use 32, 64 or 128")
    if mixed not in ("auto", "off"):
        raise QuantizationError(f"{option('mixed_precision')} must be auto or off, not {mixed!r}")
    # w8a8 in the matmulnbits form quantizes activations at run time: without text it is
    # round-to-nearest with no SmoothQuant; its other forms need static activation ranges
    w8a8_static = scheme == "w8a8" and form != "matmulnbits"
    weight_algo = scheme != "w8a8" and algo in NEEDS_CALIB  # w8a8's weights are always RTN
    needs = (w8a8_static or weight_algo or mixed == "auto") and form != "npu"
    if needs and not calib_files:
        what = (
            f"w8a8 {option('form', form)} (static activation ranges)"
            if w8a8_static
            else (
                f"algorithm {algo!r}" if algo in NEEDS_CALIB else option("mixed_precision", "auto")
            )
        )
        raise QuantizationError(
            f"{what} needs calibration text; pass {option('calib_files')} "
            "(documents separated by blank lines)"
        )
    if algo.startswith("ort-") and (scheme not in ("w4a16", "w4a8") or mixed == "auto"):
        raise QuantizationError(f"{algo} is a baseline for w4a16/w4a8 without mixed precision")


def check_kv_layout(
    src: Path, manifest: Manifest, kv_cache: str, kv_granularity: str | None
) -> None:
    """The layouts quantize takes (concat, shared) and what each takes of the int8 KV options."""
    layout = manifest.kv.layout
    if manifest.dtype not in ("float32", None):
        raise QuantizationError(
            f"{src} is a {manifest.dtype} artifact; quantization starts from float32 weights: "
            "quantize an export without --dtype"
        )
    if layout not in ("concat", "shared"):
        raise QuantizationError(
            f"{src} uses the {layout!r} KV layout; re-export with --kv-layout concat and quantize that"
        )
    if kv_cache != "int8":
        return
    if manifest.kv.dtype != "float32":
        raise QuantizationError(
            f"{src} already has a {manifest.kv.dtype} KV cache; quantize its float source instead"
        )
    if layout == "concat" and kv_granularity not in (None, default_kv_granularity("concat")):
        raise QuantizationError(
            f"the concat layout's int8 KV cache has one scale per KV head; drop "
            f"{option('kv_granularity', kv_granularity)} or quantize a shared-layout export"
        )


def check_chain(
    src: Path, out: Any, manifest: Manifest, scheme: str, algo: str, kv_cache: str
) -> None:
    """A second weight quantization of a quantized artifact is refused, with the command to run
    on its float source instead: it would quantize already-quantized weights while the manifest
    described only one recipe. What the first step did not cover (an int8 KV cache with
    `--scheme none` after weight quantization) is allowed, and the history keeps both steps."""

    quant = manifest.quant or {}
    done = quant.get("scheme")
    if scheme == "none" or done in (None, "none"):
        return
    steps = entries(manifest)
    made = next(
        (
            e
            for e in reversed(steps)
            if e.get("command") == "quantize"
            or (e.get("command") == "export" and (e.get("options") or {}).get("quant"))
        ),
        None,
    )
    recipe = f"--scheme {scheme}" + (f" --algo {algo}" if algo != "default" else "")
    if made is not None and made.get("command") == "quantize":
        float_src = (made.get("input") or {}).get("path", "FLOAT_ARTIFACT")
        fix = f"run `specport quantize {float_src} --out {out} {recipe}` on the float artifact"
    elif made is not None:
        source = (made.get("input") or {}).get("path", "MODEL")
        fix = (
            f"export it without --quant (`specport export {source} --out FLOAT`) and run "
            f"`specport quantize FLOAT --out {out} {recipe}`"
        )
    else:
        fix = f"run `specport quantize FLOAT_ARTIFACT --out {out} {recipe}` on the float artifact it was made from"
    kv_hint = (
        "; to add only an int8 KV cache, use --scheme none --kv-cache int8"
        if kv_cache != "int8" and manifest.kv.dtype == "float32"
        else ""
    )
    raise QuantizationError(
        f"{src} already holds {done} {quant.get('algorithm') or ''} weights; quantizing them "
        f"again would quantize quantized weights. Instead, {fix}{kv_hint}.".replace("  ", " ")
    )


def check_budget_options(
    scheme: str,
    algo: str,
    form: str,
    mixed: str,
    lm_head_bits: int | str | None,
    embedding_bits: int | None,
    bits_per_weight: float | None,
    mixture: str | None,
) -> float | None:
    """A size budget (`bits_per_weight` or a named `mixture`) and what it decides itself;
    returns the target in bits per weight (None without a budget)."""
    from specport.passes.quant.budget import resolve_budget

    target = resolve_budget(bits_per_weight, mixture)
    if target is None:
        return None
    what = option("mixture", mixture) if mixture else option("bits_per_weight", bits_per_weight)
    if scheme not in ("w4a8", "w4a16"):
        raise QuantizationError(f"{what} plans w4a8 or w4a16 weights, not {scheme}")
    if algo.startswith("ort-") or form != "matmulnbits" or mixed != "off":
        raise QuantizationError(
            f"{what} chooses every tensor's width itself: drop {option('algo', algo)}, "
            f"{option('form', form)} and {option('mixed_precision')}"
            if algo.startswith("ort-")
            else f"{what} takes the matmulnbits form without {option('mixed_precision')}"
        )
    if lm_head_bits is not None or embedding_bits is not None:
        raise QuantizationError(
            f"{what} chooses the LM head's and the embedding table's widths within the budget; "
            f"drop {option('lm_head_bits')} and {option('embedding_bits')}"
        )
    return target


def check_frequent_head_rows(
    rows: int | None, scheme: str, target_bpw: float | None, lm_head_bits: int | str | None = None
) -> None:
    """`--frequent-head-rows` keeps the tied head's frequent rows at 8 bits: 8-bit MatMulNBits
    is fast only with int8 activations (w4a8). Inside a budget the planner widens the rest;
    outside one the rare rows are 4-bit, so `--lm-head-bits` is 4 or left out. None: the
    planner's choice, where there is a budget."""
    if not rows:
        return
    if rows < 0:
        raise QuantizationError(f"{option('frequent_head_rows')} must be positive, got {rows}")
    if scheme != "w4a8":
        raise QuantizationError(
            f"{option('frequent_head_rows')} keeps the LM head's frequent rows at 8 bits, which "
            f"runs fast only with int8 activations: use it with {option('scheme')} w4a8"
        )
    if target_bpw is None and lm_head_bits not in (None, 4):
        raise QuantizationError(
            f"{option('frequent_head_rows')} puts the head's other rows at 4 bits; drop "
            f"{option('lm_head_bits')} {lm_head_bits} (or keep the head whole without "
            f"{option('frequent_head_rows')})"
        )
