"""llama.cpp as a `specport bench` peer, through the `llama-cpp-python` package.

CPU users most often pick llama.cpp, so it is the peer to beat at every bit width. It runs the
same checkpoint as a GGUF file: the artifact's own source when that is a GGUF, or the file given
with `--peer-gguf`. The GGUF is re-quantized once (llama.cpp's own `llama_model_quantize`,
cached) to the type that matches the artifact's precision — F32 for fp32, Q8_0 for 8-bit,
Q4_0 for 4-bit — or to the type named after a colon (`--peer llama.cpp:Q4_K_M`), so that each
row compares equal bit widths. It decodes greedily with the same thread count for prefill and
decode, and never stops at EOS, so every engine makes the same number of tokens.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from specport.artifact import manifest as art
from specport.bench.peer_base import peer_metrics
from specport.bench.peer_cache import Entry, content_key, evict, file_sha256
from specport.core.errors import InputError, SpecportError

logger = logging.getLogger(__name__)

# llama.cpp's `llama_ftype` values for the types the bench compares (llama.h)
FTYPES = {
    "F32": 0,
    "F16": 1,
    "Q4_0": 2,
    "Q4_1": 3,
    "Q8_0": 7,
    "Q5_0": 8,
    "Q5_1": 9,
    "Q4_K_S": 14,
    "Q4_K_M": 15,
    "Q5_K_M": 17,
    "Q6_K": 18,
    "BF16": 32,
}


def matching_type(manifest: art.Manifest) -> str:
    """The GGUF type with the artifact's weight bit width (what a fair side-by-side compares)."""
    scheme = (manifest.quant or {}).get("scheme", "none")
    if scheme in ("w8a8", "w8a16"):
        return "Q8_0"
    if str(scheme).startswith("w4"):
        return "Q4_0"
    return "F32"


def source_gguf(manifest: art.Manifest, explicit: str | None) -> Path:
    """The GGUF of the artifact's checkpoint: `--peer-gguf`, else the artifact's GGUF source."""
    if explicit:
        path = Path(explicit).expanduser()
        if not path.is_file():
            raise InputError(f"--peer-gguf {explicit}: no such file.")
        return path
    original = str(manifest.source.get("path") or "")
    if original.lower().endswith(".gguf") and Path(original).is_file():
        return Path(original)
    raise InputError(
        "--peer llama.cpp needs a GGUF of the same checkpoint: the artifact was not exported from "
        "one. Pass --peer-gguf FILE (llama.cpp's convert_hf_to_gguf.py makes one from the "
        "model directory)."
    )


def quantized_copy(source: Path, gguf_type: str, threads: int) -> Entry:
    """`source` re-quantized by llama.cpp to `gguf_type`, cached by the source's content and
    llama.cpp's version (a copy or re-conversion of the same GGUF reuses it); held until
    `release()`."""
    import llama_cpp

    version = f"llama-cpp-python {getattr(llama_cpp, '__version__', '?')}"
    key = content_key([], file_sha256(source), version)  # the name is no part of the content
    entry = Entry("llama.cpp", f"{key}-{gguf_type}.gguf")
    if entry.ready():
        entry.used()
        return entry
    tmp = entry.temp()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[gguf_type]
    params.allow_requantize = True  # the source may itself be quantized (dequantized first)
    params.nthread = threads
    logger.info("llama.cpp: quantizing %s to %s", source.name, gguf_type)
    t0 = time.perf_counter()
    with _quiet_stderr():
        rc = llama_cpp.llama_model_quantize(
            str(source).encode(), str(tmp).encode(), ctypes.byref(params)
        )
    if rc != 0 or not tmp.exists():
        entry.discard(tmp)
        raise SpecportError(f"llama.cpp could not quantize {source} to {gguf_type} (code {rc}).")
    entry.commit(tmp)
    entry.used()
    logger.info("llama.cpp: %s ready in %.1fs", gguf_type, time.perf_counter() - t0)
    evict(keep=entry.path)
    return entry


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """llama.cpp logs from C straight to fd 2; keep it off the user's terminal and logs."""
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        yield
        return
    saved = os.dup(fd)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), fd)
        try:
            yield
        finally:
            os.dup2(saved, fd)
            os.close(saved)


class LlamaCppPeer:
    """llama.cpp decoding the same checkpoint at the same bit width (or the named GGUF type)."""

    def __init__(
        self, manifest: art.Manifest, config: Any, gguf_type: str | None, gguf: str | None
    ) -> None:
        try:
            import llama_cpp
        except ImportError as e:
            raise SpecportError(
                "--peer llama.cpp needs `pip install llama-cpp-python` (builds llama.cpp from "
                "source, several minutes)."
            ) from e
        wanted = (gguf_type or matching_type(manifest)).upper()
        if wanted not in FTYPES:
            raise InputError(
                f"unknown llama.cpp type {wanted!r}; choose from {', '.join(sorted(FTYPES))}."
            )
        self.threads = int(config.threads or (os.cpu_count() or 1))
        self.source = source_gguf(manifest, gguf)
        self.entry = quantized_copy(self.source, wanted, self.threads)
        self.path = self.entry.path
        self.type = wanted
        self.version = getattr(llama_cpp, "__version__", "?")
        self.n_ctx = 0
        self.llm: Any = None
        self.draft: Any = None  # a llama_cpp draft model (prompt lookup) for its own speculation
        self._llama = llama_cpp.Llama

    def ensure(self, n_ctx: int) -> Any:
        """The loaded model with a context of at least `n_ctx` tokens."""
        if self.llm is None or n_ctx > self.n_ctx:
            self.n_ctx = max(n_ctx, 512)
            with _quiet_stderr():
                self.llm = self._llama(
                    model_path=str(self.path),
                    n_ctx=self.n_ctx,
                    n_batch=max(self.n_ctx, 512),
                    n_threads=self.threads,
                    n_threads_batch=self.threads,
                    draft_model=self.draft,
                    verbose=False,
                )
        return self.llm

    def info(self) -> dict[str, Any]:
        return {
            "gguf": str(self.path),
            "gguf_type": self.type,
            "source_gguf": str(self.source),
            "threads": self.threads,
            "version": self.version,
        }

    def run(self, prompts: Sequence[Sequence[int]], new_tokens: int) -> dict[str, Any]:
        if len(prompts) != 1:
            raise InputError("--peer llama.cpp runs batch 1 only (llama-cpp-python has no batch).")
        prompt = [int(t) for t in prompts[0]]
        llm = self.ensure(len(prompt) + new_tokens + 8)
        llm.reset()
        made = 0
        t0 = time.perf_counter()
        t1 = t0
        # `generate` yields after each model run + greedy pick and does not stop at EOS
        for _token in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            made += 1
            if made == 1:
                t1 = time.perf_counter()  # prefill done and the first token chosen
            if made >= new_tokens:
                break
        t2 = time.perf_counter()
        return peer_metrics(1, len(prompt), made - 1, t0, t1, t2)

    def close(self) -> None:
        if self.llm is not None:
            self.llm.close()
            self.llm = None
        self.entry.release()
