"""Which KV layout and tree-mask form an export gets, and the refusals that go with them.

`auto` resolves in two steps: from the options alone (before anything is loaded, so a bad
combination fails in a second), then from the model's head dims and attention windows once it
is known. Every choice carries a reason, which the manifest keeps and `specport inspect` shows.
"""

from __future__ import annotations

from typing import Any

from specport.core.contract import TREE_MASK
from specport.core.errors import ExportError
from specport.passes.pipelines import pipeline_for

SHARED_MAX_LENGTH = 4096  # default KV buffer limit of a shared-layout artifact

# manifest["tree_mask"] of an artifact exported with tree_mask=True (the runtime checks the
# graph input itself; this record is for people and other tools reading the manifest).
TREE_MASK_INFO = {
    "input": TREE_MASK,
    "dtype": "int64",
    "shape": ["batch", "sequence_length", "sequence_length"],
    "meaning": "1 = new token i may attend new token j; lower-triangular = plain causal",
}
# The fused attention op derives a causal mask from attention_mask: it would drop the tree.
TREE_UNFUSABLE = ("fuse_attention",)


def check_tree_mask(tree_mask: bool, kv_layout: str, passes: list[str] | None) -> None:
    """Refuse tree-mask options no graph can honour (before loading anything)."""
    if not tree_mask or kv_layout != "concat":  # shared: the fused attention takes the tree
        return
    bad = [p for p in passes or [] if p in TREE_UNFUSABLE]
    if bad:
        raise ExportError(
            f"--tree-mask cannot run pass(es) {bad}: the fused attention builds its own causal "
            "mask and would ignore the tree. Drop them from --passes."
        )


def auto_fallback(
    kv_shapes: list[tuple[int, int, int]], config: Any, tree_mask: bool, layout: str, why: str
) -> tuple[str, str]:
    """auto: (layout, why) once the model is known: concat where the fused path cannot go."""
    if bad_head_dims(kv_shapes):
        return "concat", (
            f"head dims {bad_head_dims(kv_shapes)} (key, value): onnxruntime's "
            "GroupQueryAttention needs equal dims that are a multiple of 16"
        )
    if tree_mask and tree_window(config) is not None:
        return "concat", (
            "--tree-mask on a sliding-window model: the fused attention's window counts buffer "
            "slots, not tree depths"
        )
    return layout, why


def tree_window(config: Any) -> int | None:
    """The sliding window a tree mask must reproduce (None: full attention, or unsupported)."""
    from specport.exporter.wrapper import sliding_layout

    try:
        return sliding_layout(config)[0]
    except ValueError:
        return None  # check_tree_model refuses it with its message


def check_tree_model(config: Any, kv_layout: str = "concat") -> None:
    """The tree mask replaces HF's masks: refuse layer kinds it cannot reproduce.

    On the shared layout the fused attention's sliding window counts cache slots, and a tree
    node's slot (P + node index) lies past its position (P + depth): it would see less of the
    past than a chain run of its path, so sliding-window models keep the concat layout.
    """
    from specport.exporter.wrapper import sliding_layout

    try:
        window, _ = sliding_layout(config)
    except ValueError as e:
        raise ExportError(
            f"--tree-mask supports full and sliding-window attention layers; this model has {e}. "
            "Export without --tree-mask and use chain speculative decoding."
        ) from e
    if window is not None and kv_layout == "shared":
        raise ExportError(
            f"--tree-mask on --kv-layout shared needs full attention; this model has a sliding "
            f"window of {window}. Use --kv-layout concat with --tree-mask for this model."
        )


def tree_passes(target: str) -> list[str]:
    """The target's pipeline minus the passes that would drop the tree mask."""

    names = [p.name for p in pipeline_for(target).passes]
    return [n for n in names if n not in TREE_UNFUSABLE]


def auto_layout(
    kv_layout: str, target: str, fuse: bool, passes: list[str] | None
) -> tuple[str, str]:
    """(layout, why) for `kv_layout` ("auto" resolves here; head dims are checked later)."""
    if kv_layout != "auto":
        return kv_layout, f"--kv-layout {kv_layout} was asked for"
    if target not in ("cpu", "cuda"):
        return (
            "concat",
            f"target {target}: the in-place layout needs onnxruntime's cpu/cuda kernels",
        )
    if not fuse:
        return "concat", "--no-fuse: the in-place layout needs the fused attention"
    if passes is not None and "fuse_attention" not in passes:
        return "concat", "--passes without fuse_attention: the in-place layout needs it"
    return "shared", "onnxruntime's fused attention runs this model in place (the fast path)"


def bad_head_dims(kv_shapes: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
    return sorted({(k, v) for _, k, v in kv_shapes if k != v or k % 16})


def check_kv_layout(kv_layout: str, target: str, fuse: bool) -> None:
    """Refuse a KV layout the passes cannot make for this target (before loading anything)."""
    if kv_layout == "concat":
        return
    if kv_layout != "shared":
        raise ExportError(f"unknown KV layout {kv_layout!r}: choose 'auto', 'concat' or 'shared'.")
    if target not in ("cpu", "cuda"):
        raise ExportError(
            f"--kv-layout shared needs onnxruntime's GroupQueryAttention (target cpu or cuda), "
            f"not target {target!r}; use --kv-layout concat for {target!r}."
        )
    if not fuse:
        raise ExportError(
            "--kv-layout shared needs the fusion passes (attention -> GroupQueryAttention); "
            "drop --no-fuse, or use --kv-layout concat."
        )


def shared_buffer_length(
    kv_layout: str,
    kv_shapes: list[tuple[int, int, int]],
    config: dict[str, Any],
    max_length: int | None,
) -> int | None:
    """The shared layout's KV limit (None for concat); refuses head dims GQA cannot run."""
    if kv_layout != "shared":
        return None
    bad = bad_head_dims(kv_shapes)
    if bad:
        raise ExportError(
            f"--kv-layout shared runs attention as onnxruntime's GroupQueryAttention, which needs "
            f"equal key/value head dims that are a multiple of 16; this model has (key, value) "
            f"head dims {bad}. Use --kv-layout concat for this model."
        )
    context = int(config.get("context_length") or SHARED_MAX_LENGTH)
    if max_length is None:
        return min(context, SHARED_MAX_LENGTH)
    if not 1 <= max_length <= context:
        raise ExportError(
            f"--max-length {max_length} is outside 1..{context} (the model's context length)."
        )
    return max_length
