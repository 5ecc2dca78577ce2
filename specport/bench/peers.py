"""Peers for `specport bench`: onnxruntime-genai, llama.cpp, transformers and OpenVINO GenAI
(peer_openvino.py, in its own venv), on the same prompts.

Each peer is built from the artifact's own source model (the manifest records its path), runs in
this process with the same thread count, and is given its best settings: onnxruntime-genai gets
intra-op threads = cores and the same spinning choice as ours, a KV buffer sized to the run
(max_length = prompt + new tokens) and EOS suppressed so every run makes the same number of
tokens; transformers runs `generate` under `torch.inference_mode` with `torch.set_num_threads`.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from specport.artifact import manifest as art
from specport.bench.peer_base import genai_precision, peer_metrics, source_dir
from specport.bench.peer_cache import Entry, content_key, evict
from specport.core.errors import InputError, SpecportError
from specport.runtime.hugepages import HugePages
from specport.runtime.session import SessionConfig

logger = logging.getLogger(__name__)

PEERS = ("onnxruntime-genai", "llama.cpp", "transformers")


SPECPORT_PEER = "specport:"  # another artifact of the same model (e.g. its int8-KV quantization)


def check_peer_name(name: str) -> str:
    """`name` if it names a peer (`llama.cpp` may carry a GGUF type: `llama.cpp:Q4_K_M`;
    `specport:DIR` is another artifact run by specport itself, on the same prompts)."""
    if name.partition(":")[0].partition("+")[0] == "openvino-genai":
        from specport.bench.peer_openvino import parse_name

        if parse_name(name).mode != "plain":
            raise InputError(
                f"peer {name!r} is OpenVINO GenAI's own speculative decoding: add --speculative "
                "ngram|draft|mtp to measure it beside specport's, or drop the + part."
            )
        return name
    if name.startswith(SPECPORT_PEER):
        if not (Path(name[len(SPECPORT_PEER) :]) / art.MANIFEST_NAME).is_file():
            raise InputError(f"peer {name!r}: {name[len(SPECPORT_PEER) :]} is not an artifact.")
        return name
    base, _, variant = name.partition(":")
    if base not in PEERS or (variant and base != "llama.cpp"):
        raise InputError(
            f"unknown peer {name!r}; choose from {', '.join(PEERS)}, openvino-genai[:default] "
            "(llama.cpp takes a GGUF type too, e.g. llama.cpp:Q4_K_M), or specport:ARTIFACT."
        )
    return name


def make_peer(name: str, manifest: art.Manifest, config: Any, progress: bool | None = None) -> Any:
    if name == "onnxruntime-genai":
        return GenaiPeer(manifest, config, progress)
    if name == "transformers":
        return TransformersPeer(manifest, config)
    base, _, variant = check_peer_name(name).partition(":")
    if base == "openvino-genai":
        from specport.bench.peer_openvino import OpenVinoPeer

        return OpenVinoPeer(manifest, config, name, progress=progress)
    if base == "llama.cpp":
        from specport.bench.peer_llamacpp import LlamaCppPeer

        return LlamaCppPeer(manifest, config, variant or None, getattr(config, "peer_gguf", None))
    raise InputError(f"unknown peer {name!r}; choose from {', '.join(PEERS)}.")


def _threads(config: Any) -> int:
    return int(config.threads or (os.cpu_count() or 1))


def greedy_generator(og: Any, model: Any, ids: np.ndarray, new_tokens: int) -> Any:
    """An onnxruntime-genai Generator that decodes exactly `new_tokens` greedy tokens after
    the prompts `ids` [B, T] (min_length = max_length: EOS does not end a row early, so every
    engine decodes the same count)."""
    batch, plen = ids.shape
    params = og.GeneratorParams(model)
    params.set_search_options(
        max_length=plen + new_tokens,
        min_length=plen + new_tokens,
        do_sample=False,
        batch_size=batch,
    )
    return og.Generator(model, params)


class GenaiPeer:
    """onnxruntime-genai cpu model built by its own builder from the same checkpoint, at the
    artifact's weight bit width (fp32, int8 or int4)."""

    def __init__(self, manifest: art.Manifest, config: Any, progress: bool | None = None) -> None:
        try:
            import onnxruntime_genai as og
        except ImportError as e:
            raise SpecportError(
                "--peer onnxruntime-genai needs `pip install onnxruntime-genai`."
            ) from e

        self.og = og
        self.hf = source_dir(manifest)
        self.precision = genai_precision(manifest)
        # a GGUF source is converted to a fresh temp directory each time: key by the file's hash
        gguf_hash = (manifest.source.get("gguf") or {}).get("sha256")
        self.entry = build_genai(
            self.hf, progress=progress, precision=self.precision, source_hash=gguf_hash
        )
        self.dir = self.entry.path
        self.threads = _threads(config)
        self.spin = SessionConfig(allow_spinning=config.allow_spinning).resolved_spinning()
        cfg = og.Config(str(self.dir))
        cfg.clear_providers()
        options = {
            "intra_op_num_threads": self.threads,
            "inter_op_num_threads": 1,
            "session.intra_op.allow_spinning": "1" if self.spin else "0",
            "session.inter_op.allow_spinning": "1" if self.spin else "0",
        }
        cfg.overlay(json.dumps({"model": {"decoder": {"session_options": options}}}))
        pages = HugePages()  # the same huge-page backing our sessions get (runtime/session.py)
        self.model = og.Model(cfg)
        pages.apply()

    def info(self) -> dict[str, Any]:
        return {
            "model_dir": str(self.dir),
            "precision": self.precision,
            "intra_op_threads": self.threads,
            "allow_spinning": self.spin,
            "version": getattr(self.og, "__version__", "?"),
        }

    def run(self, prompts: Sequence[Sequence[int]], new_tokens: int) -> dict[str, Any]:
        og = self.og
        ids = np.asarray(prompts, dtype=np.int32)
        batch, plen = ids.shape
        gen = greedy_generator(og, self.model, ids, new_tokens)
        t0 = time.perf_counter()
        gen.append_tokens(ids)  # prefill: runs the model, leaves the logits for the first token
        if not gen.is_done():
            gen.generate_next_token()  # only samples from the prefill logits (no model run)
        t1 = time.perf_counter()  # first token: from here every step runs the model once
        steps = 0
        while not gen.is_done():
            gen.generate_next_token()
            steps += 1
        t2 = time.perf_counter()
        del gen
        return peer_metrics(batch, plen, steps, t0, t1, t2)

    def close(self) -> None:
        del self.model
        self.entry.release()


def build_genai(
    hf_dir: Path,
    progress: bool | None = None,
    precision: str = "fp32",
    source_hash: str | None = None,
) -> Entry:
    """The genai cpu model, built once per checkpoint content (`source_hash`, else the sha256 of
    the directory's files), builder version and precision; held until `release()`."""
    import onnxruntime_genai as og

    if not any(
        (hf_dir / name).exists() for name in ("tokenizer.json", "tokenizer.model", "vocab.json")
    ):
        raise SpecportError(
            f"onnxruntime-genai's builder needs a tokenizer in {hf_dir} (tokenizer.json); "
            "add one there, or bench without --peer onnxruntime-genai."
        )
    files = [] if source_hash else [p for p in hf_dir.glob("*") if p.is_file()]
    version = f"onnxruntime-genai {getattr(og, '__version__', '?')}"
    key = content_key(files, source_hash or "", version)
    entry = Entry("onnxruntime-genai", f"{key}-{precision}")
    if (entry.path / "genai_config.json").exists():
        entry.used()
        return entry
    entry.clear()  # an incomplete entry left by an older specport
    show = sys.stderr.isatty() if progress is None else progress
    if show:
        print(
            f"[peer] building onnxruntime-genai {precision}/cpu model from {hf_dir} ...",
            file=sys.stderr,
            flush=True,
        )
    from onnxruntime_genai.models import builder

    tmp = entry.temp()
    t0 = time.perf_counter()
    import contextlib
    import io

    sink = io.StringIO()
    # The builder prints per-tensor progress on stdout; keep stdout clean for --json.
    try:
        with (
            contextlib.redirect_stdout(sys.stderr if show else sink),
            contextlib.redirect_stderr(sys.stderr if show else sink),
        ):
            opts = builder.parse_extra_options(
                None, str(hf_dir), str(tmp), precision, "cpu", str(tmp / "cache"), []
            )
            builder.create_model(
                None, str(hf_dir), str(tmp), precision, "cpu", str(tmp / "cache"), **opts
            )
    except BaseException:
        entry.discard(tmp)
        raise
    import shutil

    shutil.rmtree(tmp / "cache", ignore_errors=True)
    entry.commit(tmp)
    entry.used()
    if show:
        print(
            f"[peer] built in {time.perf_counter() - t0:.1f}s -> {entry.path}",
            file=sys.stderr,
            flush=True,
        )
    evict(keep=entry.path)
    return entry


class TransformersPeer:
    """The PyTorch model with `generate` (greedy, min_new_tokens = max_new_tokens)."""

    def __init__(self, manifest: art.Manifest, config: Any) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.threads = _threads(config)
        torch.set_num_threads(self.threads)
        self.hf = source_dir(manifest)
        self.model = AutoModelForCausalLM.from_pretrained(str(self.hf), dtype=torch.float32).eval()

    def info(self) -> dict[str, Any]:
        return {
            "model_dir": str(self.hf),
            "threads": self.threads,
            "version": self.torch.__version__,
        }

    def run(self, prompts: Sequence[Sequence[int]], new_tokens: int) -> dict[str, Any]:
        torch = self.torch
        from transformers import LogitsProcessor, LogitsProcessorList

        stamps: list[float] = []

        class Stamp(LogitsProcessor):  # called once per new token, right after its forward pass
            def __call__(self, input_ids: Any, scores: Any) -> Any:
                stamps.append(time.perf_counter())
                return scores

        ids = torch.tensor(np.asarray(prompts, dtype=np.int64))
        batch, plen = ids.shape
        with torch.inference_mode():
            t0 = time.perf_counter()
            self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
                logits_processor=LogitsProcessorList([Stamp()]),
            )
            t2 = time.perf_counter()
        t1 = stamps[0] if stamps else t2
        return peer_metrics(
            batch, plen, max(len(stamps) - 1, 0), t0, t1, stamps[-1] if stamps else t2
        )

    def close(self) -> None:
        del self.model
