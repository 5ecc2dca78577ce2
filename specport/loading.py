"""Opening an artifact for the API: `load` and the session settings its manifest asks for.

Kept apart from `specport.model` (what a loaded model does) so that opening one - manifest and
hash checks, provider choice, KV dtype alignment, tokenizer, suffix corpus - reads in one place.
`specport.api` re-exports both names.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from specport import artifact as art
from specport.model import Model
from specport.runtime.kv.layouts import align_kv_dtype, check_runtime_dtype
from specport.runtime.session import (
    SessionConfig,
    artifact_graph,
    artifact_session_entries,
    make_session,
)
from specport.runtime.speculative.suffix_corpus import read_corpus
from specport.runtime.static_session import open_static, static_info
from specport.tokenizer import load_tokenizer


def load(
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
) -> Model:
    """Open an artifact: validate manifest and file hashes, start an onnxruntime session.

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
    model = Model(directory, manifest, session, used, tokenizer, config)
    if suffix_corpus is not None:
        model.suffix_index.extend(read_corpus(suffix_corpus, tokenizer, manifest.vocab_size))
    return model
