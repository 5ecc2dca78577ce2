"""Training the EAGLE draft head: soft labels, the objective, `train_draft` end to end on a tiny
chat model (seconds): the artifact it writes, continuing a run, the feature cache, the
messages the model writes itself, held-out acceptance as the runtime proposer accepts."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from specport.core.contract import EAGLE_FEATURES
from specport.exporter.eagle_head import EagleHead
from specport.train.eagle_objective import ttt_loss
from tests.fixtures import eagle_config, tiny_eagle_head

CFG = eagle_config()


def test_soft_labels_are_the_targets_top_k_with_its_argmax_first():
    from specport.train.eagle_cache import top_k

    rng = np.random.default_rng(0)
    logits = rng.standard_normal((5, 300)).astype(np.float32)
    logits[2, [7, 3, 250]] = 9.0  # a three-way tie: the lowest id is the greedy choice
    ids, probs = top_k(logits, 4)
    assert ids[:, 0].tolist() == logits.argmax(-1).tolist()
    assert ids[2, :3].tolist() == [3, 7, 250]
    full = torch.from_numpy(logits).softmax(-1).numpy()
    np.testing.assert_allclose(probs, np.take_along_axis(full, ids, -1), rtol=2e-3)
    assert (np.diff(probs.astype(np.float32), axis=-1) <= 0).all()


def test_soft_labels_on_the_choice_alone_train_what_greedy_labels_train():
    """With all the target's mass on its choice (or the rest outside the draft vocabulary),
    the soft objective is the greedy cross-entropy; spread mass changes it."""
    head = tiny_eagle_head()
    t = 8
    feats, ids = torch.randn(1, t, 96), torch.randint(0, 50, (1, t))
    labels = torch.randint(0, 20, (1, t))
    greedy = ttt_loss(head, feats, ids, labels, 2).loss
    top = torch.stack([labels, torch.full_like(labels, -1)], -1)
    one_hot = ttt_loss(head, feats, ids, labels, 2, (top, torch.tensor([0.6, 0.4]).expand(1, t, 2)))
    torch.testing.assert_close(one_hot.loss, greedy)
    spread = torch.stack([labels, (labels + 1) % 20], -1)
    other = ttt_loss(head, feats, ids, labels, 2, (spread, torch.full((1, t, 2), 0.5)))
    assert not torch.isclose(other.loss, greedy)
    assert other.stats == one_hot.stats  # hits count against the choice either way


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
    from specport.artifact import manifest as art

    before = json.loads((chat_artifact / "specport.json").read_text())
    manifest = art.read_manifest(eagle_artifact)  # hashes checked
    eagle = manifest.extra["eagle"]
    assert (eagle_artifact / eagle["graph"]).is_file()
    assert (eagle_artifact / eagle["int8_graph"]).is_file()
    assert eagle["training"]["logits_max_abs_diff"] == 0.0
    held = eagle["training"]["heldout"]
    assert len(held["acceptance_per_position"]) == eagle["training"]["depth"]
    assert 1.0 <= held["expected_tokens_per_step"] <= 1 + eagle["training"]["depth"]
    assert EAGLE_FEATURES in {o["name"] for o in manifest.io["outputs"]}
    # the training data stays beside the artifact (for a longer run), never in its files
    assert (Path(f"{eagle_artifact}.training") / "features" / "done.json").is_file()
    assert not any(f.startswith("training") for f in manifest.files)
    assert json.loads((chat_artifact / "specport.json").read_text()) == before
    assert "eagle" not in before


def test_the_int8_draft_graph_computes_the_heads_logits_and_runs_on_cpu(eagle_artifact):
    """The CPU provider runs the head with int8 weights on onnxruntime's fused attention (a
    draft run's time is its weights' bytes and its node count); its logits follow the float graph's (random inputs of unit scale, wider than
    the real features, with activations quantized per run: ~10% of the largest logit)."""
    import onnxruntime as ort

    import specport
    from specport.runtime.speculative.eagle import draft_graph, eagle_info

    info = eagle_info(specport.load(eagle_artifact, threads=1).manifest)
    cfg = info["config"]
    assert info["int8_attention"] == "GroupQueryAttention"  # head size 16: the fused graph
    rng = np.random.default_rng(0)
    feed = {
        "input_ids": rng.integers(0, cfg["vocab"], (1, 3)),
        "features": rng.standard_normal((1, 3, 3 * cfg["hidden"])).astype(np.float32),
        "hidden_in": np.zeros((1, 3, cfg["hidden"]), np.float32),
        "past_key": rng.standard_normal((1, cfg["kv_heads"], 4, cfg["head_dim"])).astype(np.float32),
        "past_value": rng.standard_normal((1, cfg["kv_heads"], 4, cfg["head_dim"])).astype(np.float32),
    }  # fmt: skip
    # the fused graph takes its attention's lengths (past 4 + 3 new), the exported one not
    lengths = {"seqlens_k": np.array([6], np.int32), "total_sequence_length": np.array(7, np.int32)}
    logits = []
    for key in ("graph", "int8_graph"):
        sess = ort.InferenceSession(str(eagle_artifact / info[key]))
        takes = {i.name for i in sess.get_inputs()}
        extra = {k: v for k, v in lengths.items() if k in takes}
        logits.append(sess.run(["draft_logits"], {**feed, **extra})[0])
    scale = float(np.abs(logits[0]).max())
    assert float(np.abs(logits[0] - logits[1]).max()) < 0.2 * scale
    assert np.corrcoef(logits[0].ravel(), logits[1].ravel())[0, 1] > 0.98
    model = SimpleNamespace(path=eagle_artifact, provider="cpu")
    assert draft_graph(model, info) == info["int8_graph"]
    assert draft_graph(SimpleNamespace(path=eagle_artifact, provider="cuda"), info) == info["graph"]


def test_training_reports_its_speed_and_a_timeline(eagle_artifact):
    from specport.artifact import manifest as art

    training = art.read_manifest(eagle_artifact).extra["eagle"]["training"]
    assert training["positions_trained"] > 0 and training["positions_per_second"] > 0
    # the data's cost as measured when it was computed (kept for a resumed run to report)
    assert training["answers_seconds"] > 0 and training["features_seconds"] > 0
    assert training["timeline"], "at least the final point"
    last = training["timeline"][-1]
    assert last["step"] == training["steps"] and last["threads"] >= 1
    assert last["positions_trained"] == training["positions_trained"]
    # the benchmark's chat prompts, measured beside the held-out split at every point
    assert all("chat_prompts" in point for point in training["timeline"])
    assert training["chat_prompts"] == last["chat_prompts"]
    assert training["chat_prompts"]["positions"] > 0
    # and the second chat set, which nothing is tuned on
    assert all("more_chat_prompts" in point for point in training["timeline"])
    assert training["more_chat_prompts"]["positions"] > 0
    assert training["labels"] == "soft (the target's top 16)"  # the default objective


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

    from specport.train import eagle_train

    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1}, raising=False)
    assert eagle_train.torch_threads(wanted, in_use) == expected


def test_timeline_rows_hold_about_the_budgeted_positions(monkeypatch):
    from specport.train import eagle_train
    from specport.train.eagle_cache import FeatureCache

    lengths = np.array([50, 60, 70, 80])
    prompts = np.array([10, 20, 30, 40])  # 40 answer positions each
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    n = int(offsets[-1])
    cache = FeatureCache(np.zeros((n, 3)), np.zeros(n), np.zeros(n), offsets, prompts)
    monkeypatch.setattr(eagle_train, "TIMELINE_POSITIONS", 80)
    assert eagle_train.timeline_rows(cache, [3, 1, 0, 2]) == [3, 1]
    monkeypatch.setattr(eagle_train, "TIMELINE_POSITIONS", 10_000)
    assert eagle_train.timeline_rows(cache, [0, 1]) == [0, 1]


def test_train_draft_refuses_an_out_it_cannot_continue(
    chat_artifact, eagle_artifact, tiny_llama_artifact, tmp_path
):
    from specport.core.errors import OutputError, UsageError
    from specport.drafting import train_draft

    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(OutputError, match="exists"):  # not a train-draft result
        train_draft(chat_artifact, other, minutes=0.1)
    with pytest.raises(UsageError, match="trained .* minutes already"):
        train_draft(chat_artifact, eagle_artifact, minutes=0.001)
    with pytest.raises(OutputError, match="another artifact"):
        train_draft(tiny_llama_artifact, eagle_artifact, minutes=5)


@pytest.mark.slow
def test_a_longer_run_continues_the_head_on_the_kept_data(chat_artifact, tmp_path):
    """`--minutes` larger on the same --out: training resumes from the checkpoint on the same
    answers and feature cache (not recomputed), and the artifact's head and report are
    replaced in place (hashes valid)."""
    from specport.artifact import manifest as art
    from specport.drafting import train_draft, training_dir

    data = tmp_path / "messages.txt"
    data.write_text("\n\n".join(f"name the colour {i}" for i in range(16)))
    out = tmp_path / "eagle"
    opts = dict(data=data, sequences=16, new_tokens=8, threads=1, progress=False)
    first = train_draft(chat_artifact, out, minutes=0.05, max_steps=6, **opts)
    done = training_dir(out) / "features" / "done.json"
    stamp = done.stat().st_mtime_ns
    second = train_draft(chat_artifact, out, minutes=0.5, max_steps=12, **opts)
    t1, t2 = first.extra["eagle"]["training"], second.extra["eagle"]["training"]
    assert t1["steps"] == 6 and t2["steps"] == 12  # continued, not restarted
    assert t2["answers_seconds"] == t1["answers_seconds"]  # the answers were not recomputed
    assert done.stat().st_mtime_ns == stamp  # nor the features
    assert [p["step"] for p in t2["timeline"]][: len(t1["timeline"])] == [
        p["step"] for p in t1["timeline"]
    ]
    assert art.read_manifest(out).extra["eagle"]["training"]["steps"] == 12  # hashes checked


def test_a_cache_on_more_sequences_runs_only_the_new_ones(tmp_path):
    """A rerun on more data copies the features of the sequences the cache holds (same rows
    as computing them again) and runs the target on the others only."""
    from specport.train.eagle_cache import build_cache, build_seconds, is_complete

    ran: list[list[int]] = []

    def run(ids: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        ran.append(ids)
        x = np.asarray(ids, np.float32)[:, None]
        top = np.asarray(ids)[:, None] + 1 + np.arange(2)[None, :]
        return np.concatenate([x, 2 * x, 3 * x], 1), top, np.full(top.shape, 0.25)

    first = [[1, 2, 3], [4, 5]]
    build_cache(tmp_path / "f", first, [1, 1], 3, run, progress=False)
    ran.clear()
    more = [[4, 5], [6, 7, 8, 9], [1, 2, 3]]  # reordered, with one new sequence
    cache = build_cache(tmp_path / "f", more, [1, 2, 1], 3, run, progress=False)
    assert ran == [[6, 7, 8, 9]]
    assert is_complete(tmp_path / "f", more) and not (tmp_path / "f.new").exists()
    assert build_seconds(tmp_path / "f") is not None
    for i, seq in enumerate(more):
        feats, tokens, choices, p = cache.sequence(i)
        assert tokens.tolist() == seq and choices.tolist() == [t + 1 for t in seq]
        soft = cache.soft(i)
        assert soft is not None and soft[0][:, 1].tolist() == [t + 2 for t in seq]
        assert soft[1][:, :2].tolist() == [[0.25, 0.25]] * len(seq)
        assert feats[:, 2].tolist() == [3.0 * t for t in seq] and p == [1, 2, 1][i]


@pytest.mark.slow
def test_more_messages_answer_only_the_new_ones(chat_artifact, tmp_path, caplog):
    """The same --out trained again on a larger --data: the messages answered before are not
    decoded again, their features are copied, and the head trains on all of them."""
    import logging

    from specport.drafting import train_draft, training_dir

    data = tmp_path / "messages.txt"
    data.write_text("\n\n".join(f"name the colour {i}" for i in range(16)))
    out = tmp_path / "eagle"
    opts = dict(data=data, new_tokens=8, threads=1, progress=False)
    first = train_draft(chat_artifact, out, minutes=0.05, max_steps=4, sequences=16, **opts)
    answers = json.loads((training_dir(out) / "answers.json").read_text())
    data.write_text("\n\n".join(f"name the colour {i}" for i in range(20)))
    with caplog.at_level(logging.INFO):
        second = train_draft(chat_artifact, out, minutes=0.5, max_steps=8, sequences=20, **opts)
    assert "answering 4 prompts (16 answered before)" in caplog.text
    copied = re.search(r"\((\d+) copied from the earlier cache\)", caplog.text)
    assert copied and int(copied.group(1)) > 0
    kept = json.loads((training_dir(out) / "answers.json").read_text())
    assert kept["answers"][:16] == answers["answers"] and len(kept["answers"]) == 20
    t1, t2 = first.extra["eagle"]["training"], second.extra["eagle"]["training"]
    assert t1["sequences"] == 16 and t2["sequences"] == 20
    assert t2["answers_seconds"] >= t1["answers_seconds"]


def test_the_command_refuses_a_shorter_run_in_one_line(chat_artifact, eagle_artifact, capsys):
    from specport.cli import main

    assert main(["train-draft", str(chat_artifact), "--out", str(eagle_artifact),
                 "--minutes", "0.001"]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert "minutes already" in err and "Traceback" not in err


def test_inspect_shows_the_draft_head(eagle_artifact, capsys):
    from specport.cli import main

    assert main(["inspect", str(eagle_artifact)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("eagle"))
    assert "eagle_draft.onnx" in line and "draft vocabulary" in line and "tokens per step" in line
    assert main(["inspect", str(eagle_artifact), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["eagle"]["graph"] == "eagle_draft.onnx"


def test_chain_counts_follow_each_origin_until_its_first_miss():
    from specport.train.eagle_train import chain_acceptance, chain_counts

    # depth j at position t drafts for origin t - j; origins 0..3 of one row
    right = np.zeros((3, 1, 4), bool)
    counted = np.ones((3, 1, 4), bool)
    counted[1, 0, 0] = counted[2, 0, :2] = False  # no origin before position 0
    right[0, 0, [0, 1, 2]] = True  # depth 0 right for origins 0, 1, 2
    right[1, 0, 1] = right[1, 0, 3] = True  # depth 1 right for origins 0 and 2
    right[2, 0, 2] = True  # depth 2 right for origin 0 ...
    right[2, 0, 3] = True  # ... and origin 1, whose depth 1 missed: never tested
    tested, accepted = chain_counts(right, counted)
    assert tested.tolist() == [4, 3, 1]  # origin 3's chain runs past the sequence at depth 1
    assert accepted.tolist() == [3, 2, 1]
    report = chain_acceptance(tested, accepted)
    assert report["acceptance_per_position"] == [0.75, 0.6667, 1.0]
    assert report["expected_tokens_per_step"] == pytest.approx(1 + 0.75 + 0.5 + 0.5, abs=1e-3)


class _TorchSession:
    """The draft graph's contract, computed by the torch head (the runtime proposer's session)."""

    def __init__(self, head: EagleHead) -> None:
        self.head = head

    def run(self, _names, feed):
        with torch.no_grad():
            out = self.head(*(torch.from_numpy(np.asarray(feed[k])) for k in feed))
        return [o.numpy() for o in out]


def test_heldout_acceptance_is_what_the_runtime_proposer_accepts():
    """The training report's acceptance per position equals what `EagleProposer`, fed the
    target's features the way a decoding loop feeds them (from the prompt's last token on),
    accepts when it drafts from every origin of the same sequences."""

    from specport.runtime.speculative.eagle import EagleProposer
    from specport.train.eagle_cache import FeatureCache
    from specport.train.eagle_train import acceptance, draft_map

    head, depth, p = tiny_eagle_head(), 3, 4
    manifest = SimpleNamespace(extra={"eagle": {"graph": "g", "config": CFG.to_json()}})
    rng = np.random.default_rng(1)
    seqs, feats = [], []
    for _ in range(2):  # sequences that follow the head's first draft most of the time
        n = 24
        f = rng.standard_normal((n, 96)).astype(np.float32)
        tok = list(rng.integers(0, 50, p + 1))
        while len(tok) < n:
            x = len(tok) - 2
            with torch.no_grad():
                t0, *_ = head(
                    torch.tensor([tok[p : x + 2]]), torch.from_numpy(f[None, p - 1 : x + 1]),
                    torch.zeros(1, x + 2 - p, 32), torch.zeros(1, 2, 0, 8), torch.zeros(1, 2, 0, 8),
                )  # fmt: skip
            tok.append(int(t0[0]) if rng.random() < 0.7 else int(rng.integers(0, 50)))
        seqs.append(tok)
        feats.append(f)
    tested, accepted = np.zeros(depth, int), np.zeros(depth, int)
    for tok, f in zip(seqs, feats):
        choices = [*tok[1:], 0]  # greedy data: the target's choice is the next token
        for o in range(p - 1, len(tok) - 1):  # origin o: real features up to o
            proposer = EagleProposer(_TorchSession(head), manifest)  # type: ignore[arg-type]
            proposer.observe({"eagle_features": f[None, p - 1 : o + 1]}, _accepted(o - p + 1))
            drafts = proposer.propose([tok[: o + 2]], depth).row(0)
            truth = choices[o + 1 : o + 1 + depth]
            for k in range(len(truth)):
                tested[k] += 1
                if drafts[k] != truth[k]:
                    break
                accepted[k] += 1
    lengths = np.array([len(s) for s in seqs])
    cache = FeatureCache(
        np.concatenate(feats),
        np.concatenate(seqs),
        np.concatenate([[*s[1:], 0] for s in seqs]),
        np.concatenate([[0], np.cumsum(lengths)]),
        np.array([p, p]),
    )
    report = acceptance(head, cache, [0, 1], draft_map(head.draft_ids.numpy(), 50), depth)
    assert accepted[1] > 0  # the chains reach past their first draft
    rates = [round(a / t, 4) for a, t in zip(accepted, tested)]
    assert report["acceptance_per_position"] == rates
    assert report["positions"] == tested[0]


def _accepted(n: int):

    return SimpleNamespace(accepted=np.array([n]))


def test_the_user_prefix_is_where_the_template_puts_a_message(chat_artifact):
    import specport
    from specport.core.chat_template import load_chat_template

    model = specport.load(chat_artifact, threads=1)
    template = load_chat_template(model)
    prefix = template.user_prefix_ids()
    ids = template.render_ids([{"role": "user", "content": "hello"}])
    assert prefix and ids[: len(prefix)] == prefix and len(ids) > len(prefix)
    header = model.tokenizer.encode("<|im_start|>user\n", add_special_tokens=False).ids
    assert prefix == header


def test_self_messages_keep_what_the_model_ended_and_a_rerun_reads_them(chat_artifact, tmp_path):
    """What the model ends within the token limit is kept, distinct; a rerun asking for as
    many samples nothing."""
    import specport
    from specport.core.chat_template import load_chat_template
    from specport.self_messages import FILE, MAX_TOKENS, self_messages

    model = specport.load(chat_artifact, threads=1)
    template = load_chat_template(model)
    got = self_messages(model, template, 16, tmp_path)
    assert len(got) == 16 and len(set(got)) == 16 and all(got)
    assert all(len(model.encode(m)) <= MAX_TOKENS + 2 for m in got)
    saved = json.loads((tmp_path / FILE).read_text())
    assert self_messages(model, template, 16, tmp_path) == got
    assert json.loads((tmp_path / FILE).read_text())["batches"] == saved["batches"]


def test_a_model_that_never_ends_a_message_gets_a_clear_error(chat_artifact, tmp_path, monkeypatch):
    """Nothing can end within 2 tokens (a message needs 4): sampling stops after a bounded
    number of batches and says what to do instead of looping."""
    import specport
    from specport import self_messages as sm
    from specport.core.chat_template import load_chat_template
    from specport.core.errors import InputError

    monkeypatch.setattr(sm, "MAX_TOKENS", 2)
    model = specport.load(chat_artifact, threads=1)
    with pytest.raises(InputError, match="does not write requests.*--data FILE"):
        sm.self_messages(model, load_chat_template(model), 16, tmp_path)


def test_train_draft_refuses_messages_and_data_together(chat_artifact, tmp_path, capsys):
    from specport.cli import main

    data = tmp_path / "m.txt"
    data.write_text("hi")
    code = main(["train-draft", str(chat_artifact), "--out", str(tmp_path / "o"),
                 "--data", str(data), "--messages", "self"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "not both" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("messages", ["self", "mixed"])
def test_train_draft_without_a_chat_template_refuses_own_messages_up_front(
    chat_artifact, tmp_path, capsys, messages
):
    """The model writes its requests after its template's user header: an artifact without a
    template is refused before any work (no staging, no output, no training folder)."""
    import shutil

    from specport.artifact import manifest as art
    from specport.artifact.files import write_artifact_manifest
    from specport.cli import main

    plain = tmp_path / "no_template"
    shutil.copytree(chat_artifact, plain)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    write_artifact_manifest(plain, art.read_manifest(plain, check_hashes=False))  # rehashed
    out = tmp_path / "o"
    code = main(["train-draft", str(plain), "--out", str(out), "--messages", messages])
    err = capsys.readouterr().err
    assert code != 0 and "need the artifact's chat template" in err and "--data FILE" in err
    assert "Traceback" not in err and "[1/5]" not in err
    assert not out.exists() and not out.with_name("o.training").exists()


@pytest.mark.slow
def test_train_draft_on_mixed_messages_answers_both_kinds(chat_artifact, tmp_path):
    """--messages mixed alternates the built-in collection's and the model's own requests
    (so the held-out split, the first sequences, holds both) and reports what it used."""
    import specport
    from specport.core.chat_template import load_chat_template
    from specport.drafting import train_draft, training_dir
    from specport.samples.chat_distill import prompts as builtin
    from specport.self_messages import FILE

    out = tmp_path / "eagle"
    manifest = train_draft(
        chat_artifact, out, messages="mixed", minutes=0.05, max_steps=4, sequences=16,
        new_tokens=8, threads=1, progress=False,
    )  # fmt: skip
    training = manifest.extra["eagle"]["training"]
    assert training["sequences"] == 16 and "wrote itself" in training["data"]
    assert training["messages_seconds"] > 0
    own = json.loads((training_dir(out) / FILE).read_text())["messages"]
    assert len(own) >= 8
    answered = json.loads((training_dir(out) / "answers.json").read_text())["prompts"]
    template = load_chat_template(specport.load(chat_artifact, threads=1))
    expected = [t for pair in zip(builtin()[:8], own[:8]) for t in pair]
    assert answered == [template.render_ids([{"role": "user", "content": t}]) for t in expected]


def test_train_draft_answers_the_shipped_real_requests_by_default(chat_artifact, tmp_path):
    """Without --data the model answers the real requests specport ships (the first of
    samples.instructions.TRAIN, as --data would render them) and every timeline point
    measures the 55 it holds apart."""
    import specport
    from specport.core.chat_template import load_chat_template
    from specport.core.prompt_files import read_prompt_file
    from specport.drafting import train_draft, training_dir
    from specport.samples.instructions import HELDOUT, TRAIN

    out = tmp_path / "eagle"
    manifest = train_draft(
        chat_artifact, out, minutes=0.05, max_steps=4, sequences=16, new_tokens=8, threads=1,
        progress=False,
    )  # fmt: skip
    training = manifest.extra["eagle"]["training"]
    assert "self-instruct" in training["data"] and training["data_kind"] == "answers"
    assert training["sequences"] == 16
    template = load_chat_template(specport.load(chat_artifact, threads=1))
    answered = json.loads((training_dir(out) / "answers.json").read_text())["prompts"]
    records = read_prompt_file(TRAIN).records[:16]
    room = 128 - 8  # the tiny model's context less the answer: a long request keeps its end
    assert answered == [template.render_ids(r.messages())[-room:] for r in records]
    assert max(len(template.render_ids(r.messages())) for r in records) > room
    held = training_dir(out) / "self_instruct_heldout_answers.json"
    assert len(json.loads(held.read_text())["prompts"]) == len(read_prompt_file(HELDOUT).records)
    assert all(p["self_instruct_heldout"]["positions"] > 0 for p in training["timeline"])
    assert training["self_instruct_heldout"] == training["timeline"][-1]["self_instruct_heldout"]


def test_train_draft_keeps_the_templated_collection_and_measures_eval_files(
    chat_artifact, tmp_path, capsys
):
    """--messages builtin still answers the built-in templated collection, and each
    --eval-data file is measured at every timeline point under its name."""
    from specport.cli import main
    from specport.drafting import training_dir

    extra = tmp_path / "mine.jsonl"
    extra.write_text("\n".join(json.dumps({"turns": [f"count to {i}"]}) for i in range(5)))
    out = tmp_path / "eagle"
    code = main(["train-draft", str(chat_artifact), "--out", str(out), "--messages", "builtin",
                 "--minutes", "0.02", "--sequences", "16", "--new-tokens", "8", "--threads", "1",
                 "--eval-data", str(extra), "--json"])  # fmt: skip
    assert code == 0
    training = json.loads(capsys.readouterr().out)["training"]
    assert training["data"].startswith("built-in prompt collection")
    assert all(p["mine"]["positions"] > 0 for p in training["timeline"])
    assert (
        len(json.loads((training_dir(out) / "eval_mine_answers.json").read_text())["prompts"]) == 5
    )
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "no prompt key"}\n')
    code = main(["train-draft", str(chat_artifact), "--out", str(tmp_path / "o"),
                 "--eval-data", str(bad)])  # fmt: skip
    err = capsys.readouterr().err
    assert code != 0 and "--eval-data" in err and "Traceback" not in err and "[1/5]" not in err


def test_a_template_that_drops_the_message_has_no_user_header():
    from specport.core.chat_template import ChatTemplate
    from specport.core.errors import InputError

    template = ChatTemplate(None, "{{ 'always the same text' }}", {})
    with pytest.raises(InputError, match="no user header.*--data FILE"):
        template.user_prefix_ids()


def test_train_draft_data_reads_prompt_files_and_their_halves(chat_artifact, tmp_path):
    """--data takes every format bench --prompts takes (a record's first turn, after its
    context), and --data-split the same seeded half."""
    import specport
    from specport.core.chat_template import load_chat_template
    from specport.core.prompt_files import read_prompt_file, select
    from specport.drafting import _file_prompts

    data = tmp_path / "p.jsonl"
    rows = [{"turns": [f"question {i}", "and then?"], "category": "c"} for i in range(40)]
    rows += [{"messages": [{"role": "system", "content": "Be brief."},
                           {"role": "user", "content": f"hello {i}"}]} for i in range(10)]  # fmt: skip
    data.write_text("\n".join(json.dumps(r) for r in rows))
    model = specport.load(chat_artifact, threads=1)
    template = load_chat_template(model)
    got = _file_prompts(model, template, data, 1000, "tune")
    tune = select(read_prompt_file(data).records, split="tune")
    assert got == [template.render_ids(r.messages()) for r in tune]
    assert 16 <= len(got) < 50
    assert len(_file_prompts(model, template, data, 20, "all")) == 20


def test_train_draft_bad_data_is_one_line_before_work(chat_artifact, tmp_path, capsys):
    from specport.cli import main

    data = tmp_path / "p.jsonl"
    data.write_text('{"turns": ["fine"]}\n{"question": "no prompt key"}\n')
    out = tmp_path / "o"
    code = main(["train-draft", str(chat_artifact), "--out", str(out), "--data", str(data)])
    err = capsys.readouterr().err
    assert code != 0 and "line 2: no prompt in it" in err and "Traceback" not in err
    assert not out.exists() and "[1/5]" not in err
    code = main(["train-draft", str(chat_artifact), "--out", str(out), "--data-split", "eval"])
    assert code == 2 and "add --data FILE" in capsys.readouterr().err
