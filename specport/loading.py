"""`load`: open an artifact as a `Model` (`specport.api` re-exports it).

The opening itself - manifest and hash checks, provider choice, KV dtype alignment, tokenizer,
suffix corpus - is `specport.loaded.LoadedArtifact.open`, below `Model`, so that a model can open
its draft the same way without importing this module.
"""

from __future__ import annotations

import os

from specport.model import Model


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
    return Model.open(
        path,
        provider=provider,
        threads=threads,
        graph_optimization=graph_optimization,
        check_hashes=check_hashes,
        allow_spinning=allow_spinning,
        prepacking=prepacking,
        mtp_branch=mtp_branch,
        suffix_corpus=suffix_corpus,
    )
