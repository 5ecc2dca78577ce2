"""KV buffers whose memory goes back to the system row by row, and what a row holds committed.

The in-place layout's buffers are [rows, Hkv, T, D] per layer: a row's head h is one run of
``T x D`` elements (1 MiB for SmolLM2-135M fp32 at 4,096 positions). Linux commits a page of
an anonymous map when it is first written, so what a row costs depends on the page size:

* 2 MiB pages (``small_pages=False``, what numpy's allocator asks for on large arrays): the
  first position written in a row commits every head's whole run, i.e. the row's whole
  ``T`` positions (189 MB per SmolLM2 row at 4,096). Decode reads each head's run through one
  TLB entry; this is the faster page size for decode at many rows (``docs/guides/serving.md``).
* 4 KiB pages (``small_pages=True``, the map advised against huge pages): a row commits
  ``ceil(n x D x itemsize / 4 KiB)`` pages per head for its first n positions, i.e. what was
  written, rounded up to 16 positions for fp32 at D = 64.

Either way the pages stay committed after the row is freed, so memory grows with the longest
content each row ever held, not with what the running requests hold. ``release`` hands a row's
pages past a kept prefix back (``MADV_DONTNEED``: the next read sees zeros), which is what lets
the batching engine keep committed KV within ``--kv-cache-space`` (``engine/kv_budget.py``).
``row_commit`` is the page arithmetic the engine's admission counts with.
"""

from __future__ import annotations

import mmap
from collections import Counter
from dataclasses import dataclass

import numpy as np

HUGE_PAGE = 2 << 20
SMALL_PAGE = mmap.PAGESIZE
_ADVICE = hasattr(mmap, "MADV_DONTNEED") and hasattr(mmap, "MADV_NOHUGEPAGE")


@dataclass
class KVBuffer:
    """One zeroed [R, H, T, D] buffer on an anonymous map (or plain numpy where Linux's advice
    is not available), with the page size its memory is committed in."""

    array: np.ndarray
    page: int
    region: mmap.mmap | None = None

    @classmethod
    def allocate(cls, shape: tuple[int, ...], dtype: np.dtype, small_pages: bool) -> KVBuffer:
        dtype = np.dtype(dtype)
        nbytes = max(1, int(np.prod(shape)) * dtype.itemsize)
        if not _ADVICE:
            return cls(np.zeros(shape, dtype), SMALL_PAGE)
        # private: a shared map (mmap's default) keeps its pages after MADV_DONTNEED
        region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        advice = mmap.MADV_NOHUGEPAGE if small_pages else getattr(mmap, "MADV_HUGEPAGE", None)
        if advice is not None:
            region.madvise(advice)
        array = np.frombuffer(region, dtype, count=int(np.prod(shape))).reshape(shape)
        return cls(array, SMALL_PAGE if small_pages else HUGE_PAGE, region)

    def release(self, row: int, keep: int) -> None:
        """Hand back the pages of row ``row`` past its first ``keep`` positions (every head).

        Only whole pages inside the released span go back (a page shared with the kept
        prefix or a neighbouring row stays); the span reads as zeros afterwards."""
        if self.region is None:
            return
        _, heads, positions, dim = self.array.shape
        item = self.array.dtype.itemsize
        run = positions * dim * item  # bytes of one head's positions
        first = (row * heads) * run
        for h in range(heads):
            start = first + h * run + keep * dim * item
            stop = first + (h + 1) * run
            start = -(-start // SMALL_PAGE) * SMALL_PAGE  # madvise takes whole 4 KiB pages
            stop = stop // SMALL_PAGE * SMALL_PAGE
            if stop > start:
                self.region.madvise(mmap.MADV_DONTNEED, start, stop - start)


def row_commit(buffers: list[KVBuffer], positions: np.ndarray | int) -> np.ndarray:
    """Bytes a row's pages hold once its first ``positions`` positions were written: each
    head's written run rounded up to whole pages, at most the row's span (on 2 MiB pages a
    head's first position commits a whole 2 MiB page; pages shared with a neighbouring row are
    counted once per row, an estimate within one page a head)."""
    n = np.asarray(positions, dtype=np.int64)
    total = np.zeros(n.shape, dtype=np.int64)
    shapes = Counter(
        (b.array.shape[1], b.array.shape[2], b.array.shape[3] * b.array.dtype.itemsize, b.page)
        for b in buffers
    )  # layers of one shape are counted once (every layer, in a uniform cache)
    for (heads, length, unit, page), count in shapes.items():
        run = length * unit  # one head's positions, bytes
        pages = -(-(np.minimum(n, length) * unit) // page) * page
        per_head = np.minimum(pages, run) if page == HUGE_PAGE else pages
        total += count * heads * per_head
    return total
