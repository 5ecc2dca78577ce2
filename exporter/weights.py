"""Keep one copy of the weights through export: fold weight transposes lazily.

`torch.onnx.export` lowers every `nn.Linear` to `MatMul(x, Transpose(W))` and, with its default
`optimize=True`, constant-folds each Transpose into a new in-memory array while the PyTorch model
still holds `W`: a second full copy of the weights (measured: +0.8x the weight bytes on a 125M
Llama). Exporting with `optimize=False` leaves every initializer as a view of the PyTorch
parameter (no copy); `fold_weight_transposes` then replaces each `Transpose(initializer)` with an
initializer whose data is an `onnx_ir.LazyTensor`: the transposed array exists only while
`ir.save` writes it, one tensor at a time. The optimizer that runs afterwards finds nothing large
left to fold.

Every initializer that views a PyTorch tensor goes through one `WeightStore` (small ones are
copied out instead): stray references to graph values (onnxscript's rewrite rules keep the last
graph they matched; passes detach values) then cannot pin the weights, because
`release_weights` empties the store after saving. One surviving view of a memory-mapped
checkpoint would otherwise keep the whole mapping resident while onnxruntime loads its copy.

Rule kept from onnxscript's constant folding: only fold when the Transpose is the weight's single
consumer. A tied embedding (read by Gather and by the LM head's Transpose) stays one initializer
plus a runtime Transpose, so it is never written twice.
"""

from __future__ import annotations

import logging
from typing import Any

import onnx_ir as ir

logger = logging.getLogger(__name__)

# Below this many elements onnxscript's optimizer folds constants itself (same default); such
# tensors are also copied out of PyTorch rather than referenced (norm weights, biases).
FOLD_MIN_ELEMENTS = 8192
STORE_KEY = "specport.weight_store"


CHUNK_BYTES = 16 << 20  # transposed weights are written in slices of about this size


def _raw_bytes(data: Any) -> memoryview:
    """Little-endian bytes of a torch tensor, any dtype (bfloat16 included), no extra copy."""
    import torch

    flat = data.contiguous().reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy())


class StoredWeight(ir.LazyTensor):
    """A lazy initializer backed by a `WeightStore`; `tofile` streams it in slices.

    `ir.save` calls `tofile`: writing a transposed weight slice by slice keeps the transient
    at ~CHUNK_BYTES instead of one full transposed copy of the largest weight (the LM head).
    """

    def __init__(self, store: WeightStore, key: str, perm: list[int] | None, **kwargs: Any):
        super().__init__(store.loader(key, perm), **kwargs)
        self._store, self._key, self._perm = store, key, perm

    def tofile(self, file: Any) -> None:
        data = self._store.view(self._key, self._perm)
        if data.dim() == 0 or data.is_contiguous():
            file.write(_raw_bytes(data))
            return
        row_bytes = max(1, data[0].numel() * data.element_size())
        step = max(1, CHUNK_BYTES // row_bytes)
        for start in range(0, data.shape[0], step):
            file.write(_raw_bytes(data[start : start + step]))


class WeightStore:
    """Owns the weights behind lazy initializers; `clear()` lets them be freed.

    A weight is either a PyTorch tensor (`tensors`) or a key of a safetensors checkpoint
    (`bound`, read afresh on each use: nothing stays resident between uses).
    """

    def __init__(self, checkpoint: Any = None) -> None:
        self.tensors: dict[str, Any] = {}
        self.bound: dict[str, str] = {}  # initializer name -> checkpoint key
        self.checkpoint = checkpoint

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.bound

    def loader(self, key: str, perm: list[int] | None = None) -> Any:
        """A function that materializes tensor `key` (transposed by `perm`) when called."""

        def load() -> ir.TensorProtocol:
            return ir.tensor_adapters.TorchTensor(self.view(key, perm).contiguous())

        return load

    def view(self, key: str, perm: list[int] | None = None) -> Any:
        """Tensor `key` as a (possibly non-contiguous) torch view, transposed by `perm`."""
        import torch

        if key in self.bound:
            data = self.checkpoint.read(self.bound[key], torch.float32)
        elif key in self.tensors:
            data = self.tensors[key].detach()
        else:
            raise RuntimeError(
                f"weight {key!r} was released; the model was already saved and freed."
            )
        return data.permute(*perm) if perm is not None else data

    def clear(self) -> None:
        self.tensors.clear()
        self.bound.clear()


def detach_weights(
    model: ir.Model,
    min_elements: int = FOLD_MIN_ELEMENTS,
    checkpoint: Any = None,
    bindings: dict[int, str] | None = None,
) -> WeightStore:
    """Route every PyTorch-backed initializer through a `WeightStore` kept in `model.meta`.

    Small tensors are copied (cheap, and passes read them as constants); large ones become
    lazy initializers that view the PyTorch data until saved. With `bindings` (data pointer of
    a parameter -> checkpoint key, see checkpoint.py) those parameters are read from
    `checkpoint` instead: the PyTorch tensors then never need to hold data. Returns the store.
    """
    import torch

    store = WeightStore(checkpoint)
    bindings = bindings or {}
    for name, value in model.graph.initializers.items():
        tensor = value.const_value
        raw = getattr(tensor, "raw", None)
        if tensor is None or not isinstance(raw, torch.Tensor):
            continue
        key = bindings.get(raw.data_ptr()) if raw.numel() else None
        if key is not None:
            store.bound[name] = key
            if tensor.size < min_elements:
                data = store.view(name)
                del store.bound[name]
                value.const_value = ir.tensor_adapters.TorchTensor(data, name=name)
                continue
        elif tensor.size < min_elements:
            value.const_value = ir.tensor_adapters.TorchTensor(raw.detach().clone(), name=name)
            continue
        else:
            store.tensors[name] = raw
        value.const_value = StoredWeight(
            store, name, None, dtype=tensor.dtype, shape=tensor.shape, name=name
        )
    model.meta[STORE_KEY] = store
    return store


def fold_weight_transposes(model: ir.Model, min_elements: int = FOLD_MIN_ELEMENTS) -> int:
    """Replace `Transpose(W)` of large single-use initializers by lazily transposed initializers.

    Works in place on the main graph after `detach_weights`; returns the number folded. The
    original initializer is removed (its only consumer is gone); the new one is named `{W}.T`.
    """
    store: WeightStore | None = model.meta.get(STORE_KEY)
    graph = model.graph
    folded = 0
    for node in list(graph):
        if node.op_type != "Transpose" or node.domain not in ("", "ai.onnx"):
            continue
        src = node.inputs[0]
        if src is None or src.name not in graph.initializers or src.const_value is None:
            continue
        tensor = src.const_value
        if store is None or src.name is None or src.name not in store:
            continue
        if tensor.size < min_elements or len(src.uses()) != 1 or src in graph.outputs:
            continue
        rank = len(tensor.shape)
        perm_attr = node.attributes.get("perm")
        perm = list(perm_attr.as_ints()) if perm_attr is not None else list(range(rank))[::-1]
        dims = tensor.shape.numpy()  # initializers have static shapes
        shape = ir.Shape([dims[p] for p in perm])
        name = f"{src.name}.T"
        lazy = StoredWeight(store, src.name, perm, dtype=tensor.dtype, shape=shape, name=name)
        new = ir.Value(name=name, shape=shape, type=ir.TensorType(tensor.dtype))
        new.const_value = lazy
        graph.register_initializer(new)
        node.outputs[0].replace_all_uses_with(new, replace_graph_outputs=True)
        graph.remove(node, safe=True)
        graph.initializers.pop(src.name)
        src.const_value = None
        folded += 1
    logger.info("folded %d weight transposes lazily", folded)
    return folded


def release_weights(model: ir.Model) -> None:
    """Free the weights behind `model` now (after saving it); the model is unusable after.

    `del model` is not enough: stray references to the graph or to detached values survive
    (see the module docstring). Clearing the store drops the last PyTorch references.
    """
    store: WeightStore | None = model.meta.pop(STORE_KEY, None)
    if store is not None:
        store.clear()
    for value in model.graph.initializers.values():
        value.const_value = None


def lazy_nbytes(model: ir.Model) -> int:
    """Bytes of initializers that are not materialized until saved (for logging/tests)."""
    return sum(
        v.const_value.nbytes
        for v in model.graph.initializers.values()
        if isinstance(v.const_value, ir.LazyTensor)
    )
