"""`specport upgrade ARTIFACT`: bring an artifact made by an older specport up to what this one
loads, in place.

One step today: an MTP artifact gets the graphs the runtime opens (without the MTP branch, and
the tree-verify graph; `passes/mtp_graphs.py`), which older versions derived each time the
artifact loaded. The new graphs are written beside the old files and the manifest last, so an
interrupted upgrade leaves a loadable artifact as it was. Only specport's own files change (new
graphs, `specport.json`, the generated interop files); the hashes are checked first, so a
tampered artifact is never re-blessed.
"""

from __future__ import annotations

import os
from pathlib import Path

from specport.artifact import manifest as art
from specport.artifact.files import write_artifact_manifest
from specport.core import history
from specport.passes.mtp_graphs import needs_mtp_graphs, write_mtp_graphs


def upgrade(artifact: str | os.PathLike[str]) -> list[str]:
    """Upgrade ``artifact`` in place; returns what was done (empty: it was up to date)."""
    directory = Path(artifact)
    manifest = art.read_manifest(directory)
    done: list[str] = []
    if needs_mtp_graphs(manifest):
        art.refuse_hard_linked_weights(art.weight_files(directory, manifest))
        graphs = write_mtp_graphs(directory, manifest)
        done.append("stored the MTP graphs " + ", ".join(sorted(graphs.values())))
    if done:
        with history.operation("upgrade", directory):
            write_artifact_manifest(directory, manifest)
    return done
