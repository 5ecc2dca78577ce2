"""Which prompt chunks prefill together: blocks of consecutive KV rows, one run per group.

The batching engine prefills prompts through ``SharedKVCache.prefill_rows``: one onnxruntime
run over a block of consecutive rows (a contiguous view of the in-place buffers, so nothing is
copied), each row's chunk right-padded to the group's longest. Batching pays because a run has
a large fixed cost: measured on SmolLM2-135M fp32 (2 threads, CPU time, load average 3.4-4.4
on the 2-core machine, 2026-11-27), a prefill run costs ~45 ms whatever its size (every weight
is read once) plus ~3.5 ms per padded token: 64 eight-token prompts one by one ~4.5 s of CPU,
in one run 1.8 s. A run is thus worth about ``RUN_TOKENS`` tokens of padding, and `groups`
cuts each block where that gives the fewest runs x ``RUN_TOKENS`` + padded tokens (a small
dynamic program over the block; a group holds at most ``max_tokens`` padded tokens).

Rows that already hold KV (a prefix-cache hit, a prompt's later chunk) join a group only when
the graph takes several new tokens per row on a past at batch > 1 (``takes_batched_steps``);
on older graphs they prefill alone, as empty rows can always group (the graph's prompt path).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

RUN_TOKENS = 12  # a run's fixed cost in padded prompt tokens (~45 ms / ~3.5 ms, see above)


@dataclass(frozen=True)
class Chunk:
    """Prompt tokens one row prefills now."""

    row: int
    start: int  # positions the row holds already (0: empty)
    n: int  # tokens to append (>= 1)


def groups(
    chunks: Sequence[Chunk], max_tokens: int, max_length: int, batched: bool
) -> list[list[Chunk]]:
    """`chunks` (one per row) cut into groups of consecutive rows, each one run.

    `max_tokens`: padded tokens (rows x longest chunk) a group holds at most (a chunk alone
    always runs); `max_length`: positions per row (padding must fit too); `batched`: the graph
    takes multi-token steps on rows that hold KV."""
    out: list[list[Chunk]] = []
    for block in _blocks(sorted(chunks, key=lambda c: c.row), batched):
        out.extend(_split(block, max_tokens, max_length))
    return out


def padded(group: Sequence[Chunk]) -> int:
    """Tokens the group's run computes: rows x its longest chunk."""
    return len(group) * max(c.n for c in group)


def _blocks(chunks: Sequence[Chunk], batched: bool) -> Iterator[list[Chunk]]:
    """Runs of consecutive rows; without batched steps a row holding KV is a block alone."""
    block: list[Chunk] = []
    for c in chunks:
        alone = not batched and c.start > 0
        if block and (alone or c.row != block[-1].row + 1 or (not batched and block[-1].start)):
            yield block
            block = []
        block.append(c)
    if block:
        yield block


def _split(block: list[Chunk], max_tokens: int, max_length: int) -> list[list[Chunk]]:
    """The cut of `block` into groups with the least RUN_TOKENS x groups + padded tokens."""
    n = len(block)
    best = [0.0] + [math.inf] * n  # best[i]: the cheapest cut of block[:i]
    cut = [0] * (n + 1)  # where the last group of block[:i] starts
    for i in range(1, n + 1):
        width = start = 0
        for j in range(i - 1, -1, -1):  # the last group is block[j:i]
            width = max(width, block[j].n)
            start = max(start, block[j].start)
            if j < i - 1 and ((i - j) * width > max_tokens or start + width > max_length):
                break  # growing the group only adds rows and width
            cost = best[j] + RUN_TOKENS + (i - j) * width
            if cost < best[i]:
                best[i], cut[i] = cost, j
    out: list[list[Chunk]] = []
    i = n
    while i > 0:
        out.append(block[cut[i] : i])
        i = cut[i]
    return out[::-1]
