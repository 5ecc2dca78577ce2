"""OpenVINO GenAI as a bench peer, for real (its venv must exist: `specport bench --peer
openvino-genai` creates it on first use): at exact fp32 its greedy tokens are specport's, and its
prompt lookup and draft-model speculation keep them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

from specport.bench import peer_openvino as ov

# repeated text, where prompt lookup proposes drafts that greedy decoding keeps
PROMPT = "Once upon a time, there was a cat. The cat sat on the mat. Once upon a time, there was"


@pytest.mark.slow
@pytest.mark.shared
def test_openvino_fp32_greedy_tokens_equal_specport(
    shared_path: Callable[..., Path], tmp_path
) -> None:
    venv = ov.venv_dir()
    if not (venv / ov.READY).exists():
        pytest.skip(f"OpenVINO GenAI's venv {venv} is absent (created on first --peer use)")
    source = shared_path("models", "stories260K")
    import specport
    from specport.artifact import manifest as art
    from specport.bench.spec_peers import SpecPeer
    from tests.export_cache import cached_export

    # the conversion goes to the peers cache (content-keyed, size-bounded): reruns reuse it
    cached_export(source, tmp_path / "art", progress=False)
    model = specport.load(tmp_path / "art", threads=1)
    ids = model.encode(PROMPT)
    reference = model.generate(prompt_ids=ids, max_new_tokens=32).tokens
    assert len(reference) > 8

    manifest = art.read_manifest(tmp_path / "art")
    config = SimpleNamespace(threads=1, allow_spinning=False, draft=str(tmp_path / "art"))
    got = {}
    for name in ("openvino-genai", "openvino-genai+lookup", "openvino-genai+draft"):
        peer = SpecPeer(name, manifest, config, num_draft=4, progress=False)
        try:
            got[name] = peer.run(ids, len(reference))
            info = peer.info()
        finally:
            peer.close()
        assert info["precision"] == "f32" and info["weight_format"] == "fp32"
    assert got["openvino-genai"].tokens == reference
    assert got["openvino-genai+lookup"].tokens == reference
    assert got["openvino-genai+draft"].tokens == reference
    # the draft is the target itself here: every draft is accepted, K + 1 tokens per run
    runs = got["openvino-genai+draft"].rounds
    assert runs is not None and runs <= 1 + -(-(len(reference) - 1) // 5) + 1
    assert info["speculation"]["draft_is_target"]


@pytest.mark.slow
@pytest.mark.shared
def test_openvino_worker_batch_gives_each_row_its_own_tokens(
    shared_path: Callable[..., Path],
) -> None:
    """A batch of equal-length prompts (benchmarks/quant_speed_peers.py times OpenVINO at batch
    8 this way) decodes every row as it decodes alone, and says its CPU time from the start."""
    venv = ov.venv_dir()
    if not (venv / ov.READY).exists():
        pytest.skip(f"OpenVINO GenAI's venv {venv} is absent (created on first --peer use)")
    python = ov.ensure_venv(progress=False)
    source = shared_path("models", "stories260K")
    entry = ov.convert(python, source, "fp32", ov.venv_versions(python), progress=False)
    worker = ov.Worker(python)
    rows = [[1, 403, 407, 261, 378], [1, 378, 261, 407, 403]]
    try:
        properties = ov.load_properties("f32", 1)
        worker.call({"op": "load", "model": str(entry.path), "properties": properties})
        alone = [worker.call({"op": "run", "ids": r, "new_tokens": 12})["tokens"] for r in rows]
        batch = worker.call({"op": "run", "ids": rows, "new_tokens": 12})
    finally:
        worker.close()
        entry.release()
    assert batch["rows"] == alone
    assert all(len(t) == 12 for t in alone)
    assert batch["c_end"] >= batch["c_start"] and batch["t_end"] > batch["t_start"]
