"""An opened artifact: manifest, onnxruntime session, tokenizer and the KV state kept between calls.

`LoadedArtifact.open` reads one in one place - manifest and hash checks, provider choice, KV dtype
alignment, tokenizer, suffix corpus. `specport.model.Model` adds generation on top;
`specport.plain_calls` and `specport.speculative_calls` drive the runtime from what this holds,
so they sit below `Model` and import this module, not it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from specport.artifact import manifest as art
from specport.core.tokenizer import encode_prompt, load_tokenizer
from specport.runtime.generator import Generator
from specport.runtime.kv.layouts import align_kv_dtype, check_runtime_dtype
from specport.runtime.session import (
    SessionConfig,
    artifact_graph,
    artifact_session_entries,
    make_session,
)
from specport.runtime.speculative.loop import KVSlot
from specport.runtime.speculative.suffix import SuffixIndex
from specport.runtime.speculative.suffix_corpus import read_corpus
from specport.runtime.static_session import open_static, static_info

logger = logging.getLogger(__name__)

_T = TypeVar("_T", bound="LoadedArtifact")


class LoadedArtifact:
    """An opened artifact: manifest, onnxruntime session, tokenizer; no generation."""

    def __init__(
        self,
        path: Path,
        manifest: art.Manifest,
        session: Any,
        provider: str,
        tokenizer: Any | None,
        session_config: Any = None,
    ) -> None:
        self.path = path
        self.manifest = manifest
        self.session = session  # the plain onnxruntime.InferenceSession
        self.provider = provider
        self.tokenizer = tokenizer
        self.session_config = session_config  # how `session` was opened (to reopen it)
        self._suffix_index: Any = None
        self._generator: Generator | None = None
        self._generator_lock = threading.Lock()
        self._spec_slot = KVSlot()
        self._spec_lock = threading.Lock()

    @property
    def suffix_index(self) -> Any:
        """The earlier outputs `speculative="suffix"` drafts from (a `SuffixIndex`, shared by
        every request): empty until given a corpus (`load(..., suffix_corpus=)`); the serving
        engine adds each finished answer."""
        if self._suffix_index is None:
            self._suffix_index = SuffixIndex()
        return self._suffix_index

    @suffix_index.setter
    def suffix_index(self, index: Any) -> None:  # e.g. one corpus for two sessions of a model
        self._suffix_index = index

    @contextmanager
    def plain_generator(self) -> Iterator[Generator]:
        """Plain decoding's `Generator` (the one step with no proposer), kept between calls:
        its KV cache and the ids it holds, so a prompt that starts with the previous call's
        prompt and answer (a chat's next turn) prefills only what follows, as llama.cpp's
        server and onnxruntime-genai's generator keep a sequence's cache. A call made while another one runs (threads) gets
        a fresh generator of its own."""
        if not self._generator_lock.acquire(blocking=False):
            yield Generator(self.session, self.manifest)
            return
        try:
            if self._generator is None or self._generator.session is not self.session:
                self._generator = Generator(self.session, self.manifest)
            yield self._generator
        finally:
            self._generator_lock.release()

    @contextmanager
    def speculative_slot(self) -> Iterator[KVSlot]:
        """The KV cache speculative calls keep between them (see `plain_generator`): a chat's
        next turn prefills only what follows the previous prompt and answer. A call made
        while another one runs gets an empty slot of its own."""
        if not self._spec_lock.acquire(blocking=False):
            yield KVSlot()
            return
        try:
            yield self._spec_slot
        finally:
            self._spec_lock.release()

    @property
    def has_mtp_branch(self) -> bool:
        """Whether the session computes the MTP drafts (`load` leaves them out unless asked)."""
        names = {o.name for o in self.session.get_outputs()}
        outputs = (self.manifest.mtp or {}).get("outputs") or {}
        return bool(outputs) and set(outputs.values()) <= names

    def ensure_mtp_branch(self) -> None:
        """Reopen the session with the MTP branch (for speculative="mtp" after a plain load)."""
        if self.has_mtp_branch or not (self.manifest.mtp or {}).get("heads"):
            return

        logger.info("reopening %s with its MTP branch for speculative='mtp'", self.path)
        config = self.session_config or SessionConfig(provider=self.provider)
        self.session, self.provider = make_session(self.path / self.manifest.model_file, config)
        align_kv_dtype(self.session, self.manifest)

    # ---- tokens <-> text -------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return encode_prompt(self.tokenizer, text)

    def decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return ""
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    @classmethod
    def open(
        cls: type[_T],
        path: str | os.PathLike[str],
        *,
        provider: str = "auto",
        threads: int = 0,
        graph_optimization: str = "all",
        check_hashes: bool = True,
        allow_spinning: bool | None = None,
        prepacking: bool = True,
        mtp_branch: bool = False,
        suffix_corpus: str | os.PathLike[str] | None = None,
    ) -> _T:
        """Open an artifact: validate manifest and file hashes, start an onnxruntime session
        (`specport.load` is this for `Model`).

        `allow_spinning` (None = only when a core is idle) and `prepacking` are explained in
        `specport.runtime.session`. An MTP artifact's session leaves the MTP branch out unless
        `mtp_branch` (every other decoding would pay for the heads, see
        `runtime.session.artifact_graph`); speculative="mtp" reopens it with the branch.
        `suffix_corpus` (JSON lines of earlier answers, `runtime.speculative.suffix_corpus`) seeds
        what speculative="suffix" drafts from."""

        directory = Path(path)
        manifest = art.read_manifest(directory, check_hashes=check_hashes)
        check_runtime_dtype(manifest, directory)
        config = SessionConfig(
            provider=provider,
            intra_op_threads=threads,
            graph_optimization=graph_optimization,
            allow_spinning=allow_spinning,
            disable_prepacking=not prepacking,
            config_entries=artifact_session_entries(manifest),
        )
        if provider.lower() == "qnn" and static_info(manifest):  # NPU: the static graph pair
            session, used = open_static(directory, manifest, config)
        else:
            graph, entries = artifact_graph(directory, manifest, mtp_branch)
            session, used = make_session(
                graph, replace(config, config_entries={**config.config_entries, **entries})
            )
        align_kv_dtype(session, manifest)
        tokenizer = load_tokenizer(directory, manifest.tokenizer)
        model = cls(directory, manifest, session, used, tokenizer, config)
        if suffix_corpus is not None:
            model.suffix_index.extend(read_corpus(suffix_corpus, tokenizer, manifest.vocab_size))
        return model
