"""MTP top-k candidates verified as a token tree: the heads graph, the loop, the CLI.

The heads graph's top-W equals the torch heads' (through a draft vocabulary too); its greedy
width-1 beam is the in-graph chain branch's drafts; tree decoding with MTP candidates gives
exactly plain greedy on both KV layouts; seeded sampling reproduces; an MTP artifact trained
before the heads graph existed gets a one-line error naming the fix.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import specport
from specport.artifact.files import write_artifact_manifest
from specport.core.errors import InputError
from specport.runtime.sampler import SamplingConfig
from specport.runtime.speculative.tree import generate_tree

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow  # exports tree-mask artifacts and MTP graphs (~1 min)


def _mtp_artifact(base: Path, out: Path, heads: int = 3, seed: int = 0) -> Path:
    from specport.exporter.mtp_artifact import write_mtp_artifact
    from specport.exporter.mtp_heads import MTPHeads
    from specport.train.mtp_train import load_base

    torch.manual_seed(seed)
    mtp = MTPHeads(load_base(specport.load(base).manifest), heads).eval()
    for p in mtp.parameters():  # away from the warm start, so every head differs
        p.data.add_(0.05 * torch.randn_like(p))
    write_mtp_artifact(base, mtp, out, {"source": "test"})
    return out


@pytest.fixture(scope="module")
def arts(tiny_zoo: Any, tmp_path_factory: Any) -> dict[str, tuple[Any, Any]]:
    """layout -> (plain tree-mask base, its MTP artifact), both loaded."""
    from specport.exporter.export import export_model

    tmp = tmp_path_factory.mktemp("mtp_tree")
    concat = tmp / "concat-tree"
    export_model(
        tiny_zoo.source("llama"), concat, kv_layout="concat", tree_mask=True, progress=False
    )
    out = {}
    for layout, base in (("shared", tiny_zoo.shared("llama", tree_mask=True)), ("concat", concat)):
        mtp = _mtp_artifact(base, tmp / f"mtp-{layout}")
        out[layout] = (
            specport.load(base, provider="cpu", threads=1),
            specport.load(mtp, provider="cpu", threads=1, mtp_branch=True),
        )
    return out


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [
        rng.integers(3, 256, size=int(rng.integers(1, 9))).tolist() * (1 + i % 3) for i in range(n)
    ]


def test_heads_graph_top_ids_equal_the_torch_heads(tiny_zoo, tmp_path):
    """Every head, several rows, with and without a draft vocabulary (ids via to_vocab)."""
    import onnxruntime as ort

    from specport.exporter.mtp_heads import MTPHeads
    from specport.exporter.mtp_heads_graph import save_heads_graph
    from tests.fixtures import load_reference

    base = load_reference(tiny_zoo.source("llama"), "llama")
    g = torch.Generator().manual_seed(0)
    for draft in (None, torch.randperm(256, generator=g)[:40]):
        torch.manual_seed(1)
        heads = MTPHeads(base, 3, draft_vocab=draft).eval()
        for p in heads.parameters():
            p.data.add_(0.05 * torch.randn_like(p))
        where = tmp_path / ("draft" if draft is not None else "full")
        where.mkdir()
        record = save_heads_graph(heads, where, width=6)
        assert record["width"] == 6
        sess = ort.InferenceSession(str(where / record["file"]), providers=["CPUExecutionProvider"])
        hidden = torch.randn(5, 64, generator=g)
        tokens = torch.randint(0, 256, (5,), generator=g)
        for k in range(3):
            nxt, ids, logp = sess.run(
                None,
                {
                    record["inputs"]["hidden"]: hidden.numpy(),
                    record["inputs"]["tokens"]: tokens.numpy(),
                    record["inputs"]["head"]: np.array([k]),
                },
            )
            with torch.no_grad():
                out, logits = heads.step(k, hidden[None], tokens[None])
                top = torch.topk(torch.log_softmax(logits[0], -1), 6, dim=-1)
            np.testing.assert_allclose(nxt, out[0].numpy(), atol=1e-4)
            np.testing.assert_allclose(logp, top.values.numpy(), atol=1e-4)
            want = heads.to_vocab(top.indices).numpy()
            gaps = np.diff(top.values.numpy(), axis=-1)  # a near tie may swap two neighbours
            tie = np.zeros_like(want, dtype=bool)
            tie[:, 1:] |= gaps > -1e-4
            tie[:, :-1] |= gaps > -1e-4
            assert np.array_equal(ids[~tie], want[~tie]), k
            if draft is not None:
                assert set(ids.ravel().tolist()) <= set(draft.tolist())


@pytest.mark.parametrize("layout", ["shared", "concat"])
def test_greedy_equals_plain(arts, layout):
    from specport.runtime.speculative.mtp_tree import mtp_tree_generator

    plain, mtp = arts[layout]
    for ids in _prompts(8):
        want = plain.generate(prompt_ids=ids, max_new_tokens=24, ignore_eos=True).tokens
        for k, width in ((1, 1), (3, 1), (2, 3), (3, 4)):
            toks, reason, metrics = generate_tree(mtp, ids, 24, k, width, method="mtp")
            assert toks == want, (layout, k, width, ids)
            spec = metrics["speculative"]
            assert reason == "length" and spec["method"] == "mtp-tree"
            assert metrics["kv_layout"] == layout
            assert spec["mean_tree_nodes"] <= k * width
            # every path kept, however unlikely: full trees from the first step on
            out = mtp_tree_generator(mtp, k, width, min_prob=0.0).generate(ids, 24)
            assert out.tokens == want, (layout, k, width, ids)
            spec = out.metrics["speculative"]
            # full trees but for the unseeded first step of a 1-token prompt and the last k
            assert spec["tree_nodes"] >= k * width * (spec["steps"] - k - 1)
        got = mtp.generate(
            prompt_ids=ids, max_new_tokens=24, ignore_eos=True, speculative="mtp", tree_width=2
        )
        assert got.tokens == want and got.metrics["speculative"]["method"] == "mtp-tree"


def test_width_one_beam_is_the_chain_branch_drafts(arts):
    """Seeded with the hidden state at the accepted position and the bonus token, the heads
    graph's greedy chain is the in-graph MTP branch's: the tree reads the right hidden row."""
    from specport.core.contract import prefill_feeds
    from specport.passes.mtp import HIDDEN_OUTPUT
    from specport.runtime.speculative.mtp_tree import (
        MTPTreeCandidates,
        heads_graph_record,
        mtp_tree_sessions,
    )

    _, mtp = arts["concat"]
    verify, heads = mtp_tree_sessions(mtp)
    assert mtp_tree_sessions(mtp)[0] is verify  # derived once per loaded model
    assert not {"mtp_accepted", "mtp_drafts"} & {o.name for o in verify.get_outputs()}
    names = [o.name for o in mtp.session.get_outputs()]
    for ids in _prompts(6, seed=3):
        ids_arr = np.asarray(ids, dtype=np.int64)
        outs = dict(zip(names, mtp.session.run(None, prefill_feeds(mtp.session, ids_arr))))
        accepted, bonus = int(outs["mtp_accepted"][0]), int(outs["mtp_bonus"][0])
        hidden = verify.run([HIDDEN_OUTPUT], prefill_feeds(verify, ids_arr))[0]  # [1, S, H]
        source = MTPTreeCandidates(heads, heads_graph_record(mtp.manifest), 3)
        assert source([*ids, bonus], 3, 1) == []  # nothing observed yet: no candidates
        source.observe({HIDDEN_OUTPUT: hidden}, [accepted])  # the path ends at that row
        paths = source([*ids, bonus], 3, 1)
        assert paths[-1] == outs["mtp_drafts"][0].tolist()
        assert [len(p) for p in paths] == [1, 2, 3]
        wide = source([*ids, bonus], 2, 4)  # a beam: each depth's paths extend kept ones
        assert len(wide) == 8 and len({tuple(p) for p in wide}) == 8
        assert all(p[:1] in wide[:4] for p in wide[4:])
        sure = MTPTreeCandidates(heads, heads_graph_record(mtp.manifest), 3, min_prob=0.999)
        sure.observe({HIDDEN_OUTPUT: hidden}, [accepted])
        assert sure([*ids, bonus], 3, 4) == []  # no path that likely: the root alone


def test_penalty_and_seeded_sampling(arts):
    plain, mtp = arts["shared"]
    ids = [5, 6, 7, 5, 6, 7, 5, 6]
    cfg = SamplingConfig(repetition_penalty=1.3)
    want = plain.generate(
        prompt_ids=ids, max_new_tokens=20, ignore_eos=True, repetition_penalty=1.3
    ).tokens
    assert generate_tree(mtp, ids, 20, 3, 3, cfg, method="mtp")[0] == want
    cfg = SamplingConfig(greedy=False, temperature=0.8, seed=7)
    a = generate_tree(mtp, ids, 20, 3, 3, cfg, method="mtp")[0]
    assert a == generate_tree(mtp, ids, 20, 3, 3, cfg, method="mtp")[0]  # seeded: reproducible
    assert len(a) == 20 and all(0 <= t < mtp.manifest.vocab_size for t in a)
    with pytest.raises(InputError, match="ngram, mtp or eagle"):
        generate_tree(mtp, ids, 4, 3, 2, method="draft")
    with pytest.raises(InputError, match="has 3"):
        generate_tree(mtp, ids, 4, 4, 2, method="mtp")


def test_old_artifact_and_wrong_artifacts_get_one_line_errors(arts, tmp_path, capsys):
    from specport.artifact import manifest as art
    from specport.cli import main

    plain, mtp = arts["shared"]
    old = tmp_path / "old"
    shutil.copytree(mtp.path, old)
    manifest = art.read_manifest(old)
    manifest.mtp = {k: v for k, v in manifest.mtp.items() if k != "heads_graph"}
    (old / "mtp_heads.onnx").unlink()
    (old / "mtp_heads.onnx.data").unlink()
    write_artifact_manifest(old, manifest)
    argv = ["generate", str(old), "--prompt-ids", "1,2,3", "--speculative", "mtp"]
    assert main([*argv, "--tree-width", "2"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "specport train-mtp" in err[0] and "Traceback" not in err[0]
    assert main([*argv, "--max-new-tokens", "4"]) == 0  # the chain path is unchanged
    capsys.readouterr()
    with pytest.raises(InputError, match="train-mtp"):  # a plain tree artifact has no heads
        generate_tree(plain, [1, 2, 3], 4, 2, 2, method="mtp")


def test_cli_generate_and_bench(arts, capsys):
    from specport.cli import main

    plain, mtp = arts["shared"]
    ids = [9, 8, 7, 9, 8, 7, 9]
    want = plain.generate(prompt_ids=ids, max_new_tokens=12).tokens
    argv = ["generate", str(mtp.path), "--prompt-ids", ",".join(map(str, ids))]
    rc = main(
        [*argv, "--max-new-tokens", "12", "--speculative", "mtp", "--tree-width", "3", "--json"]
    )
    assert rc == 0
    row = json.loads(capsys.readouterr().out)
    assert row["tokens"] == want and row["metrics"]["speculative"]["method"] == "mtp-tree"
    bench = [
        "bench",
        str(mtp.path),
        "--speculative",
        "mtp",
        "--tree-width",
        "1",
        "--tree-width",
        "2",
    ]
    rc = main([*bench, "--prompt-ids", "5,6,7", "--new-tokens", "8", "--runs", "1", "--json"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    engines = {r["engine"]: r for r in report["rows"]}
    assert set(engines) == {"plain", "mtp", "mtp-tree1", "mtp-tree2"}
    assert all(r["tokens_equal_plain"] for r in report["rows"])
