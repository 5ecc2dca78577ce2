"""How many requests the batching engine admits, and how its KV memory stays within the space.

The in-place layout reserves ``rows x max_length`` positions per layer up front on anonymous
maps (``kv.memory``): Linux hands out their pages only when onnxruntime first writes a
position, so rows that are never filled cost address space, not memory. The engine therefore
reserves many rows (``plan_rows``: up to ``MAX_ROWS``, with the whole reservation within half
of the machine's memory) and admits a waiting request only while what the running requests'
rows may come to commit — each one's prompt plus its token budget, the most its row can grow
to, in whole pages — fits in the KV space (``KVBudget``; ``serve --kv-cache-space``, default
``default_kv_space``). This is vLLM's rule (its scheduler admits by free KV blocks, sized by
``VLLM_CPU_KVCACHE_SPACE`` on CPU) without paging. By default a request reserves its worst
case at admission, so no running request is ever preempted; with ``--preemption-mode
recompute`` it reserves what it holds now plus a few steps, and the engine preempts the newest
request when the reservations would overrun the space (``admission``).

Pages stay committed after a request ends (its KV stays for the prefix cache), and on 2 MiB
pages a row's first position commits the whole row (189 MB for SmolLM2-135M at 4,096
positions). Counting only running requests, the server's memory once grew to 5.7 GB with
0.5 GiB of KV space (``docs/benchmarks/2026-12-05-serving-traffic.md``). So: when every row
filled to the end fits the space, the buffers take 2 MiB pages (decode's faster ones) and
nothing more is needed; otherwise they take 4 KiB pages, committed as written, and after each
admission ``KVBudget.fit`` hands back what would overrun the space — a running row's pages past
what its request may write, then idle rows' cached KV, least recently used first. The pages
committed then stay within the space (plus a page per head of a free row inside a decode
batch), whatever the traffic.

Before this, ``serve`` admitted 8 requests (``--max-batch 8``): at 16 concurrent requests
half of them waited a whole answer for a row (SmolLM2 fp32: TTFT p50 2.4 s).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from specport.artifact.manifest import Manifest

logger = logging.getLogger(__name__)

MAX_ROWS = 64  # rows the engine reserves at most without an explicit --max-batch
DEFAULT_SPACE = 4 << 30  # bytes of KV the engine fills at most by default (4 GiB) ...
DEFAULT_SPACE_SHARE = 0.25  # ... or this share of the memory available at start, if less
ROWS_MEMORY_SHARE = 0.5  # rows x max_length x token bytes stays within this share of RAM


def token_bytes(manifest: Manifest) -> int:
    """Bytes one position takes across every layer's key and value buffers."""
    kv = manifest.kv
    total = 0
    for heads, kd, vd, name in zip(kv.num_heads, kv.key_dim, kv.value_dim, kv.dtypes()):
        total += int(heads) * (int(kd) + int(vd)) * _itemsize(name)
    return total


def _itemsize(dtype_name: str) -> int:
    return int(np.dtype(dtype_name).itemsize)


def _meminfo(key: str) -> int | None:
    """A /proc/meminfo value in bytes (None off Linux)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def available_memory() -> int | None:
    """The memory the kernel can give without swapping, in bytes (None off Linux)."""
    return _meminfo("MemAvailable")


def total_memory() -> int | None:
    """The machine's memory in bytes (None when it cannot be read)."""
    total = _meminfo("MemTotal")
    if total is None and hasattr(os, "sysconf"):
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            return None
    return total


def default_kv_space() -> int:
    """The KV space a server fills by default: 4 GiB, or a quarter of the memory available at
    start when that is less."""
    available = _meminfo("MemAvailable")
    if available is None:
        return DEFAULT_SPACE
    return max(1 << 20, min(DEFAULT_SPACE, int(available * DEFAULT_SPACE_SHARE)))


def plan_rows(manifest: Manifest, max_length: int, max_batch: int | None = None) -> int:
    """The rows to reserve: `max_batch` when given; else up to `MAX_ROWS`, as many as keep
    rows x max_length positions within half of the machine's memory (at least 1)."""
    if max_batch is not None:
        return max_batch
    memory = total_memory()
    if memory is None:
        return 8
    row = max(1, token_bytes(manifest) * max_length)
    return max(1, min(MAX_ROWS, int(memory * ROWS_MEMORY_SHARE) // row))


@dataclass
class KVBudget:
    """Admission by KV space: the bytes each running request's row may come to commit, summed;
    and (`fit`) the pages rows still hold, so the KV committed stays within the space."""

    space: int  # bytes
    per_token: int  # bytes per position (`token_bytes`)
    reserved: dict[int, int] = field(default_factory=dict)  # row -> tokens it may hold
    # bytes a row's pages hold for n written positions (`SharedKVCache.commit_bytes`:
    # whole pages); None: n x per_token
    commit: Callable[[int], int] | None = None
    # bytes_for by token count: the sum is taken at every admission and, with preemption,
    # at every step where a row's reservation grows (a page count is a numpy call)
    _bytes: dict[int, int] = field(default_factory=dict, repr=False)

    @property
    def capacity(self) -> int:
        """Tokens that fit in the space."""
        return self.space // max(1, self.per_token)

    @property
    def used(self) -> int:
        return sum(self._tokens())

    def _tokens(self) -> tuple[int, ...]:
        # one copy in C (under the GIL): `stats` reads it from the server's thread
        return tuple(self.reserved.values())

    def bytes_for(self, tokens: int) -> int:
        """What a row that may hold `tokens` positions commits at most."""
        if not self.commit:
            return tokens * self.per_token
        known = self._bytes.get(tokens)
        if known is None:
            known = self._bytes[tokens] = int(self.commit(tokens))
        return known

    @property
    def reserved_bytes(self) -> int:
        return sum(self.bytes_for(t) for t in self._tokens())

    def admits(self, tokens: int) -> bool:
        """Can a request that may hold `tokens` positions start now? A request alone is always
        admitted (a budget smaller than one request must not stall the server forever: its
        row exists and was checked against the KV length)."""
        return not self.reserved or self.reserved_bytes + self.bytes_for(tokens) <= self.space

    def fit(self, held: np.ndarray, idle: Sequence[int]) -> tuple[dict[int, int], list[int]]:
        """What to hand back so the rows' pages fit the space: (running row -> positions to
        keep, for a row whose pages reach past what its request may write, e.g. a longer
        request's before), and the `idle` rows (least recently used first: a finished
        request's KV kept for the prefix cache) to release whole. `held` [rows]: the bytes
        each row's pages hold now (`SharedKVCache.held_bytes`). Running rows count what they
        may come to hold, so once this is applied the pages committed stay within the space
        until the next admission or, with preemption, reservation growth (with a request
        alone past it as the exception)."""
        trims = {r: t for r, t in self.reserved.items() if int(held[r]) > self.bytes_for(t)}
        over = self.reserved_bytes + sum(int(held[r]) for r in idle) - self.space
        drop: list[int] = []
        for row in idle:
            if over <= 0:
                break
            if held[row] > 0:
                drop.append(row)
                over -= int(held[row])
        return trims, drop

    def reserve(self, row: int, tokens: int) -> None:
        self.reserved[row] = tokens

    def release(self, row: int) -> None:
        self.reserved.pop(row, None)

    def move(self, old: int, new: int) -> None:
        """A request moved rows (the engine compacts rows)."""
        if old in self.reserved:
            self.reserved[new] = self.reserved.pop(old)

    def swap(self, a: int, b: int) -> None:
        """Two requests exchanged rows (the engine orders new prompts by length)."""
        ta, tb = self.reserved.pop(a, None), self.reserved.pop(b, None)
        if ta is not None:
            self.reserved[b] = ta
        if tb is not None:
            self.reserved[a] = tb

    def stats(self) -> dict[str, int]:
        return {
            "kv_space_bytes": self.space,
            "kv_space_tokens": self.capacity,
            "kv_reserved_tokens": self.used,
            "kv_reserved_bytes": self.reserved_bytes,
        }
