"""Per-row text streams: incremental detokenization plus stop strings.

Text is emitted as soon as it is final: never half of a multi-byte character, and never text
that could still turn out to be the start of a stop string (that is held back until it is not).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from specport.runtime.detokenize import IncrementalDetokenizer


class TextStreams:
    def __init__(
        self,
        tokenizer: Any | None,
        rows: int,
        stop: Sequence[str] = (),
        on_text: Callable[[int, str], None] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.on_text = on_text
        self.text = [""] * rows  # everything emitted so far
        self.pending = [""] * rows  # decoded but held back (possible stop-string prefix)
        self.stopped = np.zeros(rows, dtype=bool)
        self.detok: list[Any] = []
        if tokenizer is not None:
            self.detok = [IncrementalDetokenizer(tokenizer) for _ in range(rows)]

    @property
    def needs_steps(self) -> bool:
        """Whether text must be produced during generation (a callback or stop strings want it).

        Otherwise `push_all` after the loop gives the same text: detokenizing per step would
        only add host work between onnxruntime runs (about 35 us a token, caches cold)."""
        return bool(self.detok) and (self.on_text is not None or bool(self.stop))

    def push_all(self, tokens: Sequence[Sequence[int]]) -> None:
        """Feed each row's whole output at once (instead of `push` per step)."""
        for r, row in enumerate(tokens):
            if self.detok and not self.stopped[r]:
                self.pending[r] += self.detok[r].extend([int(t) for t in row])
                self._check(r)

    def push(self, new: np.ndarray, active: np.ndarray) -> np.ndarray | None:
        """Feed one token per active row; returns rows whose stop string just matched."""
        if not self.detok:
            return None
        hit = np.zeros(len(self.text), dtype=bool)
        for r in np.flatnonzero(active & ~self.stopped):
            hit[r] = self.push_row(int(r), int(new[r]))
        return hit if hit.any() else None

    def push_row(self, row: int, token: int) -> bool:
        """Feed one token of one row (the engine's per-row callback); True when its stop
        string just matched."""
        if not self.detok or self.stopped[row]:
            return False
        self.pending[row] += self.detok[row].add(token)
        return self._check(row)

    def _check(self, r: int) -> bool:
        buf = self.pending[r]
        if self.stop:
            for s in self.stop:
                idx = buf.find(s)
                if idx >= 0:
                    self._emit(r, buf[:idx])
                    self.pending[r] = ""
                    self.stopped[r] = True
                    return True
            keep = max(
                (k for s in self.stop for k in range(1, len(s)) if buf.endswith(s[:k])), default=0
            )
        else:
            keep = 0
        self._emit(r, buf[: len(buf) - keep])
        self.pending[r] = buf[len(buf) - keep :]
        return False

    def _emit(self, r: int, piece: str) -> None:
        if piece:
            self.text[r] += piece
            if self.on_text is not None:
                self.on_text(r, piece)

    def finish(self) -> list[str]:
        for r in range(len(self.text)):
            if self.detok and not self.stopped[r]:
                self.pending[r] += self.detok[r].flush()
                self._check(r)
                self._emit(r, self.pending[r])
                self.pending[r] = ""
        return self.text
