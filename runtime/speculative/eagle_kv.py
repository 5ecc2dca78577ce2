"""The EAGLE head's runs with its KV written in place: one buffer bound as past and present.

A draft graph that takes its attention's lengths (``exporter.eagle_graph.LENGTH_INPUTS``) runs
like the target's shared layout: the head's one layer keeps a ``kv.layouts.SharedKV`` buffer
[1, Hkv, T, Dh] per key and value, bound through IO binding as both ``past_*`` and
``present_*``, so onnxruntime writes the new positions into it and nothing of size O(T) is fed,
returned, allocated or copied per run. The state is one length: the positions whose real
features the head has seen; a chain's draft positions are written after it and forgotten by
not advancing it (the next catch-up run overwrites them), as the target forgets rejected ones.

Each run width has an IO binding of its own, made once (binding an OrtValue costs ~10 us): the
catch-up runs over ``n`` pending positions (features in, ``hidden_in`` zero) and two one-token
draft bindings that feed each other's ``hidden_out`` as ``hidden_in`` (features zero), so a
chain of drafts writes one id and two lengths per run. The buffer starts at ``START`` positions
and doubles when a run would pass its end (the kept positions copied once, every binding made
again).

Measured against the concat runs (past fed in, present returned: two [1, Hkv, P, Dh] arrays
made and returned per head run) in ``docs/benchmarks/2026-12-06-eagle-host.md``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from specport.artifact.manifest import KVLayout
from specport.core.contract import EAGLE_LENGTH_INPUTS as LENGTH_INPUTS
from specport.runtime.kv.layouts import SharedKV

START = 256  # positions of a new buffer (a request's drafts and accepted tokens: it doubles)
MAX_WIDTHS = 8  # catch-up widths whose bindings are kept (a chain's accepted + 1: 1..K+1)


def takes_lengths(session: Any) -> bool:
    """Does the draft graph take its attention's lengths (so its KV can stay in place)?"""
    try:
        names = {i.name for i in session.get_inputs()}
    except AttributeError:  # a stand-in session without graph metadata
        return False
    return set(LENGTH_INPUTS) <= names


class _Binding:
    """One run shape's IO binding and the arrays it reads and writes (made once)."""

    def __init__(
        self,
        head: InPlaceHead,
        width: int,
        features: np.ndarray,  # [1, width, 3H] (a view of the pending rows, or zeros)
        hidden_in: np.ndarray,  # [1, width, H]
        hidden_out: np.ndarray,  # [1, width, H]
    ) -> None:
        import onnxruntime as ort

        ov = ort.OrtValue.ortvalue_from_numpy
        self.ids = np.zeros((1, width), np.int64)
        self.features = features
        self.hidden_in = hidden_in  # [1, width, H]
        self.hidden_out = hidden_out  # [1, width, H]
        arrays: dict[str, np.ndarray] = {
            "input_ids": self.ids,
            "features": self.features,
            "hidden_in": hidden_in,
            LENGTH_INPUTS[0]: head.seqlens,
            LENGTH_INPUTS[1]: head.total,
        }
        outs: dict[str, np.ndarray] = {
            "draft_token": head.token,
            "draft_logits": head.logits,
            "hidden_out": hidden_out,
        }
        self.binding = head.session.io_binding()
        head.kv.bind(self.binding)
        self._values: list[Any] = []  # the OrtValues must outlive the binding
        for name, arr in arrays.items():
            self._values.append(ov(arr))
            self.binding.bind_ortvalue_input(name, self._values[-1])
        for name, arr in outs.items():
            self._values.append(ov(arr))
            self.binding.bind_ortvalue_output(name, self._values[-1])


class InPlaceHead:
    """A draft session's runs at batch 1 over its own in-place KV (module docstring)."""

    def __init__(
        self,
        session: Any,
        hidden: int,  # H
        feat_dim: int,  # 3H
        kv_heads: int,  # Hkv
        head_dim: int,  # Dh
        draft_vocab: int,  # Vd
    ) -> None:
        self.session = session
        self.hidden, self.feat_dim = hidden, feat_dim
        self.layout = KVLayout(
            layout="shared",
            inputs=[["past_key", "past_value"]],
            outputs=[["present_key", "present_value"]],
            num_heads=[kv_heads],
            key_dim=[head_dim],
            value_dim=[head_dim],
            dtype=_kv_dtype(session),
        )
        self.seqlens = np.zeros(1, np.int32)  # length after the run - 1
        self.total = np.zeros((), np.int32)
        self.token = np.zeros(1, np.int64)  # [1] the draft as a target id
        self.logits = np.zeros((1, draft_vocab), np.float32)  # [1, Vd]
        self.length = 0  # positions with real features
        self._zero_feat = np.zeros((1, 1, feat_dim), np.float32)
        self._stage: np.ndarray | None = None  # the pending rows the catch-up widths read
        self._allocate(START)

    def _allocate(self, capacity: int) -> None:
        old = getattr(self, "kv", None)
        self.layout.max_length = capacity
        self.kv = SharedKV(self.layout, 1, capacity)
        if old is not None:
            for new, buf in zip(self.kv.buffers, old.buffers):
                new[:, :, : self.length] = buf[:, :, : self.length]
        self._widths: dict[int, _Binding] = {}
        h = self._h = [np.zeros((1, 1, self.hidden), np.float32) for _ in range(2)]
        # draft run d reads h[d % 2] and writes h[(d + 1) % 2]
        zero = self._zero_feat
        self._drafts = [_Binding(self, 1, zero, h[0], h[1]), _Binding(self, 1, zero, h[1], h[0])]

    @property
    def capacity(self) -> int:
        return self.kv.max_length

    def reset(self) -> None:
        self.length = 0  # the buffer is kept: stale positions are overwritten

    @property
    def key(self) -> np.ndarray:
        """The real positions' keys [1, Hkv, length, Dh] (a view of the buffer)."""
        return self.kv.buffers[0][:, :, : self.length]

    @property
    def value(self) -> np.ndarray:
        return self.kv.buffers[1][:, :, : self.length]

    def _fit(self, positions: int) -> None:
        capacity = self.capacity
        while capacity < positions:
            capacity *= 2
        if capacity != self.capacity:
            self._allocate(capacity)

    def _run(self, bound: _Binding, end: int) -> None:
        """Run ``bound`` with the KV ending at ``end`` positions after it."""
        self.seqlens[0] = end - 1
        self.total[()] = end
        self.session.run_with_iobinding(bound.binding)

    def catch_up(
        self, ids: list[int], stage: np.ndarray, n: int, room: int
    ) -> tuple[int, np.ndarray]:
        """Run over the n pending real positions (ids [n], their features ``stage[:n]``, the
        proposer's staging rows [rows, 3H], read in place); their KV becomes the head's, and
        ``room`` draft positions after them fit the buffer. Returns the first draft (a
        target id) and the draft-vocabulary logits [1, Vd] (a view, overwritten by the next
        run)."""
        self._fit(self.length + n + room)
        if stage is not self._stage:  # a new (grown) staging array: bound again
            self._stage, self._widths = stage, {}
        bound = self._widths.get(n)
        if bound is None:
            if len(self._widths) >= MAX_WIDTHS:
                self._widths.pop(next(iter(self._widths)))
            zero = np.zeros((1, n, self.hidden), np.float32)
            # one position: its hidden output is the first draft run's input, written there
            out = self._h[0] if n == 1 else np.zeros((1, n, self.hidden), np.float32)
            bound = self._widths[n] = _Binding(self, n, stage[None, :n], zero, out)
        if n == 1:
            bound.ids[0, 0] = ids[0]
        else:
            bound.ids[0] = ids
        self.length += n
        self._run(bound, self.length)
        if n > 1:  # the first draft run continues from the last position's hidden output
            self._h[0][0, 0] = bound.hidden_out[0, -1]
        return int(self.token[0]), self.logits

    def last_hidden(self) -> np.ndarray:
        """The hidden output [1, 1, H] of the last catch-up's last position (a copy)."""
        return self._h[0].copy()

    def draft(self, token: int, d: int) -> int:
        """Draft run ``d`` (0, 1, ...) after a ``catch_up``: ``token`` (the previous draft) at
        position length + d, attending the real positions and the drafts before it; its KV is
        forgotten at the next catch-up. Returns the next draft (a target id)."""
        bound = self._drafts[d % 2]
        bound.ids[0, 0] = token
        self._run(bound, self.length + d + 1)
        return int(self.token[0])


def _kv_dtype(session: Any) -> str:
    past = next(i for i in session.get_inputs() if i.name == "past_key")
    return "float16" if past.type == "tensor(float16)" else "float32"
