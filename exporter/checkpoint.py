"""Read a safetensors checkpoint one tensor at a time, and build a model that holds no weights.

Bounded-memory export: the graph is traced on a `hollow_model` whose parameters are CPU
tensors with unallocated pages (torch.empty: address space, no resident memory; tracing runs
on fake tensors and never reads them), and each initializer is then bound to the checkpoint
tensor it came from (`Checkpoint.read`, one tensor in memory at a time, converted to float32 on
read). Nothing the size of the model is ever resident while the graph is built and written.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specport.core.errors import InvalidModelError

logger = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: str  # safetensors code: F32, BF16, F16, ...
    shape: tuple[int, ...]


class Checkpoint:
    """The tensors of a Hugging Face safetensors checkpoint (single file or sharded)."""

    def __init__(self, tensors: dict[str, TensorInfo]) -> None:
        self.tensors = tensors

    @classmethod
    def open(cls, model_dir: Path) -> Checkpoint | None:
        """The checkpoint in `model_dir`, or None when it has no safetensors weights."""
        index = model_dir / INDEX_NAME
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text()).get("weight_map", {})
            files = sorted({model_dir / f for f in weight_map.values()})
        elif (model_dir / SINGLE_NAME).is_file():
            files = [model_dir / SINGLE_NAME]
        else:
            return None
        tensors: dict[str, TensorInfo] = {}
        for f in files:
            if not f.is_file():
                return None
            for key, meta in _read_header(f).items():
                if key != "__metadata__":
                    tensors[key] = TensorInfo(f, meta["dtype"], tuple(meta["shape"]))
        return cls(tensors)

    def __contains__(self, key: str) -> bool:
        return key in self.tensors

    def read(self, key: str, dtype: Any = None) -> Any:
        """Tensor `key` as a torch tensor (a private copy), converted to `dtype` if given."""
        from safetensors import safe_open

        info = self.tensors[key]
        with safe_open(str(info.file), framework="pt") as f:
            t = f.get_tensor(key)
        return t if dtype is None or t.dtype == dtype else t.to(dtype)


def _read_header(path: Path) -> dict[str, Any]:
    """The safetensors header of `path`, checked against the file's size before any work (a
    truncated download would otherwise fail deep inside tracing)."""

    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header: dict[str, Any] = json.loads(f.read(n)) if 8 + n <= size else {}
        end = max(
            (m["data_offsets"][1] for k, m in header.items() if k != "__metadata__"), default=0
        )
        complete = bool(header) and 8 + n + end <= size
    except (ValueError, KeyError, TypeError, IndexError):
        complete = False
    if not complete:
        raise InvalidModelError(
            f"could not load weights from {path}: the file is shorter than its header says. "
            "The weight files are truncated or corrupt; re-download the model."
        )
    return header


def bind_parameters(model: Any, checkpoint: Checkpoint) -> dict[int, str] | None:
    """Map each parameter (by data pointer; tied weights share one) to its checkpoint key.

    None when some parameter is not stored under its own name with its own shape (a family
    whose loader renames or fuses tensors): such a model is exported the ordinary way.
    """
    bound: dict[int, str] = {}
    missing: list[str] = []
    for name, p in model.named_parameters(remove_duplicate=False):
        ptr = p.data_ptr()
        if ptr in bound:
            continue
        info = checkpoint.tensors.get(name)
        if info is not None and info.shape == tuple(p.shape):
            bound[ptr] = name
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.data_ptr() not in bound:
            missing.append(name)
    if missing:
        logger.info(
            "checkpoint does not store %d parameter(s) by name (%s ...)", len(missing), missing[0]
        )
        return None
    return bound


def hollow_model(config: Any, load_kwargs: dict[str, Any]) -> Any:
    """The float32 model of `config` with parameters that occupy no memory.

    Parameters are built on the meta device (buffers such as rotary frequencies are computed
    for real) and then given uninitialized CPU storage, which the kernel backs with pages only
    when written: tracing (fake tensors) never touches them. Use `probe_kv_shapes_meta`
    for anything that would run the model.
    """
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **load_kwargs)
    fresh: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) not in fresh:
                fresh[id(p)] = torch.nn.Parameter(
                    torch.empty(p.shape, dtype=p.dtype, device="cpu"), requires_grad=False
                )
            module._parameters[name] = fresh[id(p)]
    # accelerate's meta context re-creates a parameter on every assignment, which unties
    # tied weights (an LM head sharing the embedding): tie them again on the real tensors.
    model.tie_weights()
    return model.eval()


def probe_kv_shapes_meta(model: Any) -> list[tuple[int, int, int]]:
    """`wrapper.probe_kv_shapes` without touching weights: run on a meta copy of the module
    tree (parameters and buffers swapped to meta for the call, then restored)."""
    import torch

    from specport.exporter.wrapper import probe_kv_shapes

    saved: list[tuple[Any, str, str, Any]] = []
    for module in model.modules():
        for kind in ("_parameters", "_buffers"):
            table = getattr(module, kind)
            for name, t in list(table.items()):
                if t is None:
                    continue
                saved.append((module, kind, name, t))
                meta = t.to("meta")
                table[name] = (
                    torch.nn.Parameter(meta, requires_grad=False) if kind == "_parameters" else meta
                )
    # with a pad token and no mask, some families (GPT-2) look for padding in the ids: a value
    # read, which meta tensors cannot give; the probe's ids hold no padding anyway
    config: Any = getattr(model, "config", None)
    pad = getattr(config, "pad_token_id", None)
    if pad is not None:
        config.pad_token_id = None
    try:
        return probe_kv_shapes(model, device="meta")
    finally:
        if pad is not None:
            config.pad_token_id = pad
        for module, kind, name, t in saved:
            getattr(module, kind)[name] = t


def streaming_model(
    source: Any, layers: int | None
) -> tuple[Any, Checkpoint, dict[int, str]] | None:
    """(hollow model, checkpoint, parameter bindings) when the weights of `source` (a resolved
    `source.Source`) can be streamed from its safetensors checkpoint, else None (the model is
    then loaded as usual). `layers` keeps the first N decoder layers."""
    import copy

    checkpoint = Checkpoint.open(source.path)
    if checkpoint is None:
        return None
    config = source.config
    scaling = getattr(config, "rope_scaling", None) or getattr(config, "rope_parameters", None)
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) == "longrope":
        # long-rope picks its frequencies from the sequence length at run time, which tracing
        # the hollow model cannot do (torch.export recursion): load it the ordinary way
        logger.info("long-rope scaling: loading the model instead of streaming its weights")
        return None
    if layers is not None:
        total = int(getattr(config, source.arch.layers_attr))
        if not 1 <= layers <= total:
            return None  # load_model raises the user-facing error
        config = copy.deepcopy(config)
        setattr(config, source.arch.layers_attr, layers)
    try:
        model = hollow_model(config, dict(source.arch.load_kwargs))
    except Exception as e:  # noqa: BLE001 - fall back to the ordinary load, which reports
        logger.info("cannot build the model without weights (%s); loading it instead", e)
        return None
    bindings = bind_parameters(model, checkpoint)
    if bindings is None:
        return None
    logger.info("streaming weights from the checkpoint (%d tensors)", len(bindings))
    return model, checkpoint, bindings
