"""The concat-layout KV of batched speculation: a left-padded cache rebuilt after each step.

``PaddedKV`` keeps every live row's cache left-padded and right-aligned in one
[B, Hkv, W, D] tensor per layer and rebuilds it after each verify step from the presents
(``compact``). ``batch.BatchSpeculativeGenerator`` drives it.
"""

from __future__ import annotations

import numpy as np

from specport.artifact import Manifest
from specport.errors import InputError
from specport.runtime.kv.layouts import ConcatKV
from specport.runtime.speculative.verify import greedy_rows

__all__ = ["PaddedKV", "greedy_rows"]  # greedy_rows: verify's, imported here before


class PaddedKV(ConcatKV):
    """Left-padded concat KV for the live rows: per tensor [n, Hkv, W, D], ``lengths`` [n]."""

    def __init__(self, manifest: Manifest, batch: int) -> None:
        if manifest.kv.layout != "concat":
            raise InputError(
                f"batched speculative decoding needs the 'concat' KV layout, this artifact has "
                f"{manifest.kv.layout!r}; re-export it without the shared-KV pass."
            )
        super().__init__(manifest, batch)
        self.lengths = np.zeros(batch, dtype=np.int64)

    @property
    def width(self) -> int:
        return self.length

    def mask(self, extra: int) -> np.ndarray:  # [n, W + extra] int64
        w = self.width
        pad = np.arange(w)[None, :] >= (w - self.lengths)[:, None]
        return np.concatenate([pad, np.ones((len(self.lengths), extra), bool)], axis=1).astype(
            np.int64
        )

    def compact(
        self,
        presents: list[np.ndarray],
        start: np.ndarray,
        keep: np.ndarray,
        rows: np.ndarray,
        pad_is_zero: bool = True,
    ) -> None:
        """Rebuild the cache from presents [n, Hkv, T, D]: batch slot r in ``rows`` keeps the
        ``keep[r]`` positions from ``start[r]`` on, left-padded (with zeros) to the longest.

        ``pad_is_zero``: the slots before each ``start[r]`` are zeros (true for every presents
        built on a cache this class made; false for a prefill's computed padding)."""
        start, keep = start[rows], keep[rows]
        new_w = int(keep.max()) if rows.size else 0
        pad = (new_w - keep).tolist()
        off = (start - (new_w - keep)).tolist()
        # Slots before a row's start are its old padding, already zero: when every row shifts
        # by the same offset (e.g. all accepted as many drafts) one slice does it.
        same = rows.size == len(self.lengths) > 0 and min(off) == max(off) >= 0
        if pad_is_zero and same:
            o = off[0]
            self.past = [np.ascontiguousarray(p[:, :, o : o + new_w]) for p in presents]
        else:
            segments = list(zip(rows.tolist(), start.tolist(), keep.tolist(), pad))
            out = []
            for p in presents:
                q = np.zeros((rows.size, p.shape[1], new_w, p.shape[3]), p.dtype)
                for i, (r, a, k, z) in enumerate(segments):
                    q[i, :, z:] = p[r, :, a : a + k]
                out.append(q)
            self.past = out
        self.lengths = keep.astype(np.int64)
