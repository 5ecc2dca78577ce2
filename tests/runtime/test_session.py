"""Opening an artifact: an MTP artifact's session leaves the MTP branch out unless it is used.

onnxruntime runs every node whatever outputs are fetched, so plain / n-gram / draft decoding on
the graph with the heads would pay for them at every step; the session opens the graph without
the branch that the artifact stores (written by train-mtp, never derived at load), and
`speculative="mtp"` reopens the full graph. Tokens must not change either way. An artifact from
before the stored graphs gets a one-line message naming `specport upgrade`, which fixes it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from tests.cli.conftest import run_cli, snapshot

pytestmark = pytest.mark.slow  # exports a tiny model and splices MTP heads in (~10 s)

MTP_OUTPUTS = {"mtp_accepted", "mtp_bonus", "mtp_drafts"}


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> tuple[Path, Path]:
    """(base artifact, the same with 2 untrained MTP heads spliced into model.onnx)."""
    pytest.importorskip("torch")
    from tests.export_cache import cached_export, cached_mtp
    from tests.fixtures import build_tiny_model

    tmp = tmp_path_factory.mktemp("session_mtp")
    build_tiny_model("llama", tmp / "src")
    base = tmp / "base"
    cached_export(tmp / "src", base, fuse=False, skip_verify=True, progress=False)
    cached_mtp(base, tmp / "mtp")
    return base, tmp / "mtp"


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [(rng.integers(3, 256, size=5).tolist()) * (1 + i) for i in range(3)]


def test_plain_and_ngram_on_an_mtp_artifact_run_without_the_branch(artifacts, caplog):
    import specport

    base_dir, mtp_dir = artifacts
    before = snapshot(mtp_dir)
    with caplog.at_level(logging.INFO, logger="specport.runtime.session"):
        mtp = specport.load(mtp_dir)
    assert "MTP branch left out" in caplog.text
    base = specport.load(base_dir)
    names = [o.name for o in mtp.session.get_outputs()]
    assert not MTP_OUTPUTS & set(names) and not mtp.has_mtp_branch
    assert names == [o.name for o in base.session.get_outputs()]
    for ids in _prompts():
        want = base.generate(prompt_ids=ids, max_new_tokens=16, ignore_eos=True).tokens
        assert mtp.generate(prompt_ids=ids, max_new_tokens=16, ignore_eos=True).tokens == want
        got = mtp.generate(prompt_ids=ids, max_new_tokens=16, ignore_eos=True, speculative="ngram")
        assert got.tokens == want
    rows = mtp.generate_batch(prompt_ids=_prompts(), max_new_tokens=8, ignore_eos=True)
    want_rows = base.generate_batch(prompt_ids=_prompts(), max_new_tokens=8, ignore_eos=True)
    assert [r.tokens for r in rows] == [r.tokens for r in want_rows]
    assert snapshot(mtp_dir) == before  # nothing written beside the user's artifact


def test_speculative_mtp_reopens_the_graph_with_its_branch(artifacts):
    import specport

    base_dir, mtp_dir = artifacts
    base = specport.load(base_dir)
    mtp = specport.load(mtp_dir)
    ids = _prompts()[1]
    want = base.generate(prompt_ids=ids, max_new_tokens=16, ignore_eos=True).tokens
    got = mtp.generate(  # fixed K: with measured costs, untrained heads need not draft
        prompt_ids=ids, max_new_tokens=16, ignore_eos=True, speculative="mtp", adaptive=False
    )
    assert got.tokens == want and got.metrics["speculative"]["drafted"] > 0
    assert mtp.has_mtp_branch  # reopened once, on first use
    full = specport.load(mtp_dir, mtp_branch=True)
    assert {o.name for o in full.session.get_outputs()} >= MTP_OUTPUTS


def test_cli_generate_keeps_the_branch_only_for_speculative_mtp(artifacts, capsys, caplog):
    base_dir, mtp_dir = artifacts
    ids = ",".join(map(str, _prompts()[2]))
    common = ["--prompt-ids", ids, "--max-new-tokens", "12", "--ignore-eos", "--json"]
    outs = {}
    for name, art, extra in [
        ("base", base_dir, []),
        ("plain", mtp_dir, []),
        ("ngram", mtp_dir, ["--speculative", "ngram"]),
        ("mtp", mtp_dir, ["--speculative", "mtp"]),
    ]:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="specport.runtime.session"):
            code, out, err = run_cli(capsys, "generate", art, *common, *extra)
        assert code == 0, err
        outs[name] = json.loads(out)["tokens"]
        assert ("MTP branch left out" in caplog.text) == (name in ("plain", "ngram"))
    assert outs["plain"] == outs["ngram"] == outs["mtp"] == outs["base"]


def test_an_old_mtp_artifact_names_the_upgrade_command_and_upgrade_fixes_it(
    artifacts, tmp_path, capsys
):
    import shutil

    import specport
    from specport.artifact import manifest as art
    from specport.artifact.files import write_artifact_manifest
    from specport.cli import main
    from specport.core.errors import ArtifactError

    base_dir, mtp_dir = artifacts
    old = tmp_path / "old"
    shutil.copytree(mtp_dir, old)
    manifest = art.read_manifest(old)
    for name in manifest.mtp.pop("graphs").values():  # as train-mtp wrote it before
        (old / name).unlink()
    write_artifact_manifest(old, manifest)
    with pytest.raises(ArtifactError, match="specport upgrade"):
        specport.load(old)
    argv = ["generate", str(old), "--prompt-ids", "1,2,3", "--max-new-tokens", "4"]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"specport upgrade {old}" in err[0]
    assert main(["upgrade", str(old), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["upgraded"]
    assert main(["upgrade", str(old)]) == 0 and "up to date" in capsys.readouterr().out
    ids = _prompts()[0]
    want = specport.load(base_dir).generate(prompt_ids=ids, max_new_tokens=12, ignore_eos=True)
    got = specport.load(old).generate(prompt_ids=ids, max_new_tokens=12, ignore_eos=True)
    assert got.tokens == want.tokens
    assert art.read_manifest(old).mtp["graphs"] == art.read_manifest(mtp_dir).mtp["graphs"]
