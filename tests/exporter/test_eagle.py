"""The EAGLE draft head: the target's feature output, the head's training-time test, the draft
graph, and `train_draft` end to end on a tiny chat model (seconds)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest
import torch

from specport.exporter.eagle_head import EagleConfig, EagleHead
from specport.passes.eagle_features import FEATURES, ExposeEagleFeaturesPass, feature_layers

CFG = EagleConfig(
    hidden=32,
    heads=4,
    kv_heads=2,
    head_dim=8,
    intermediate=64,
    rope_theta=10000.0,
    eps=1e-5,
    vocab=50,
    draft_vocab=20,
)


def _head() -> EagleHead:
    torch.manual_seed(0)
    return EagleHead(CFG, torch.randn(50, 32), torch.arange(0, 40, 2)).eval()


def test_feature_output_leaves_logits_unchanged(tiny_llama_artifact, tmp_path):
    import onnxruntime as ort

    from specport import artifact as art
    from specport.exporter.eagle_artifact import copy_with_features
    from specport.runtime.kv.seq_cache import open_cache

    manifest = art.read_manifest(tiny_llama_artifact)
    new, report = copy_with_features(tiny_llama_artifact, tmp_path / "a", manifest)
    assert report["layers"] == [*feature_layers(manifest.num_layers), "final_norm"]
    assert FEATURES in {o["name"] for o in new.io["outputs"]}
    model = ir.load(str(tmp_path / "a" / manifest.model_file))
    assert not ExposeEagleFeaturesPass(manifest.num_layers)(model).modified  # already there

    featured = ort.InferenceSession(str(tmp_path / "a" / manifest.model_file))
    plain = ort.InferenceSession(str(tiny_llama_artifact / manifest.model_file))
    ids = [1, 5, 9, 40, 7, 3]
    a = open_cache(plain, manifest).step(ids)
    b = open_cache(featured, manifest).step(ids)
    np.testing.assert_array_equal(a.logits, b.logits)
    hidden = int(manifest.config["hidden_size"])
    assert b.outputs[FEATURES].shape == (1, len(ids), 3 * hidden)


def test_head_with_kv_computes_what_training_time_test_trains():
    """Drafting from origin 5 with the head's KV (depth 0, then its own hidden output at
    depths 1 and 2) gives the logits the training-time test scores at those depths."""
    head = _head()
    t = 10
    feats = torch.randn(1, t, 96)
    ids = torch.randint(0, 50, (1, t))
    seen = []
    logits = head.logits
    head.logits = lambda g: seen.append(logits(g)) or seen[-1]  # type: ignore[method-assign]
    with torch.no_grad():
        head.ttt_loss(feats, ids, torch.zeros(1, t, dtype=torch.long), 3)
    head.logits = logits  # type: ignore[method-assign]
    with torch.no_grad():
        empty = torch.zeros(1, 2, 0, 8)
        _, l0, g, k, v = head(ids[:, :6], feats[:, :6], torch.zeros(1, 6, 32), empty, empty)
        _, l1, g, k, v = head(ids[:, 6:7], torch.zeros(1, 1, 96), g[:, -1:], k, v)
        _, l2, _, _, _ = head(ids[:, 7:8], torch.zeros(1, 1, 96), g[:, -1:], k, v)
    # depth j scores positions j..T-1 (masked rows dropped): position t is row t - j
    torch.testing.assert_close(seen[0][5], l0[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(seen[1][6 - 1], l1[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(seen[2][7 - 2], l2[0], atol=1e-5, rtol=0)


def test_draft_graph_matches_the_head(tmp_path):
    import onnxruntime as ort

    from specport.exporter.eagle_artifact import export_draft

    head = _head()
    export_draft(head, tmp_path / "d.onnx")
    sess = ort.InferenceSession(str(tmp_path / "d.onnx"))
    ids = np.array([[3, 7, 11]])
    feats = np.random.default_rng(0).standard_normal((1, 3, 96)).astype(np.float32)
    empty = np.zeros((1, 2, 0, 8), np.float32)  # no past: the first run of a request
    token, logits, hidden, key, _ = sess.run(
        None,
        {
            "input_ids": ids,
            "features": feats,
            "hidden_in": np.zeros((1, 3, 32), np.float32),
            "past_key": empty,
            "past_value": empty,
        },
    )
    with torch.no_grad():
        t_tok, t_logits, _, _, _ = head(
            torch.from_numpy(ids),
            torch.from_numpy(feats),
            torch.zeros(1, 3, 32),
            torch.zeros(1, 2, 0, 8),
            torch.zeros(1, 2, 0, 8),
        )
    assert int(token[0]) == int(t_tok[0])
    assert int(token[0]) in range(0, 40, 2)  # a target id of the draft vocabulary
    np.testing.assert_allclose(logits, t_logits.numpy(), atol=2e-3)  # fp16 embedding table
    assert hidden.shape == (1, 3, 32) and key.shape == (1, 2, 3, 8)


@pytest.fixture(scope="module")
def chat_artifact(tiny_zoo, tmp_path_factory) -> Path:
    from tests.fixtures import add_chat_tokenizer

    return add_chat_tokenizer(tiny_zoo.artifact("llama"), tmp_path_factory.mktemp("eagle") / "chat")


@pytest.fixture(scope="module")
def eagle_artifact(chat_artifact, tmp_path_factory) -> Path:
    """A tiny artifact with a briefly trained EAGLE head (also used by the runtime tests)."""
    from specport.drafting import train_draft

    data = tmp_path_factory.mktemp("msgs") / "messages.txt"
    data.write_text("\n\n".join(f"tell me about the number {i}" for i in range(24)))
    out = tmp_path_factory.mktemp("drafted") / "eagle"
    train_draft(
        chat_artifact,
        out,
        data=data,
        minutes=0.1,
        sequences=24,
        new_tokens=12,
        threads=1,
        progress=False,
        max_steps=30,
    )
    return out


def test_train_draft_writes_a_new_artifact_and_leaves_the_input(chat_artifact, eagle_artifact):
    from specport import artifact as art

    before = json.loads((chat_artifact / "specport.json").read_text())
    manifest = art.read_manifest(eagle_artifact)  # hashes checked
    eagle = manifest.extra["eagle"]
    assert (eagle_artifact / eagle["graph"]).is_file()
    assert eagle["training"]["logits_max_abs_diff"] == 0.0
    held = eagle["training"]["heldout"]
    assert len(held["acceptance_per_position"]) == eagle["training"]["depth"]
    assert 1.0 <= held["expected_tokens_per_step"] <= 1 + eagle["training"]["depth"]
    assert FEATURES in {o["name"] for o in manifest.io["outputs"]}
    assert not Path(f"{eagle_artifact}.work").exists()  # the work folder is gone once done
    assert json.loads((chat_artifact / "specport.json").read_text()) == before
    assert "eagle" not in before


def test_training_reports_its_speed_and_a_timeline(eagle_artifact):
    from specport import artifact as art

    training = art.read_manifest(eagle_artifact).extra["eagle"]["training"]
    assert training["positions_trained"] > 0 and training["positions_per_second"] > 0
    # the data's cost as measured when it was computed (kept for a resumed run to report)
    assert training["answers_seconds"] > 0 and training["features_seconds"] > 0
    assert training["timeline"], "at least the final point"
    last = training["timeline"][-1]
    assert last["step"] == training["steps"] and last["threads"] >= 1
    assert last["positions_trained"] == training["positions_trained"]


@pytest.mark.parametrize(
    ("load", "in_use", "wanted", "expected"),
    [
        (0.1, 0, 2, 2),  # an idle machine: the asked threads
        (2.1, 2, 2, 2),  # our own two threads are the load
        (7.5, 1, 2, 1),  # others fill both cores: one thread
        (3.0, 0, 2, 1),  # others fill them before we start
        (9.0, 1, 1, 1),  # one asked, one given
    ],
)
def test_torch_threads_drop_to_one_on_a_busy_machine(monkeypatch, load, in_use, wanted, expected):
    import os

    from specport.exporter import eagle_train

    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1}, raising=False)
    assert eagle_train.torch_threads(wanted, in_use) == expected


def test_timeline_rows_hold_about_the_budgeted_positions(monkeypatch):
    from specport.exporter import eagle_train
    from specport.exporter.eagle_cache import FeatureCache

    lengths = np.array([50, 60, 70, 80])
    prompts = np.array([10, 20, 30, 40])  # 40 answer positions each
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    n = int(offsets[-1])
    cache = FeatureCache(np.zeros((n, 3)), np.zeros(n), np.zeros(n), offsets, prompts)
    monkeypatch.setattr(eagle_train, "TIMELINE_POSITIONS", 80)
    assert eagle_train.timeline_rows(cache, [3, 1, 0, 2]) == [3, 1]
    monkeypatch.setattr(eagle_train, "TIMELINE_POSITIONS", 10_000)
    assert eagle_train.timeline_rows(cache, [0, 1]) == [0, 1]


def test_train_draft_refuses_an_existing_out(chat_artifact, eagle_artifact):
    from specport.drafting import train_draft
    from specport.errors import OutputError

    with pytest.raises(OutputError, match="exists"):
        train_draft(chat_artifact, eagle_artifact, minutes=0.1)


def test_inspect_shows_the_draft_head(eagle_artifact, capsys):
    from specport.cli import main

    assert main(["inspect", str(eagle_artifact)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("eagle"))
    assert "eagle_draft.onnx" in line and "draft vocabulary" in line and "tokens per step" in line
    assert main(["inspect", str(eagle_artifact), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["eagle"]["graph"] == "eagle_draft.onnx"
