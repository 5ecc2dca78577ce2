"""EAGLE proposer: greedy output equals plain greedy token for token; the head's KV holds real
positions only; features pair with the right tokens whatever the loop shows it."""

from __future__ import annotations

import functools
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from specport.runtime.speculative.eagle import EagleProposer

PROMPTS = [[1, 5, 6, 7, 8, 5, 6], [1, 74, 75, 76, 90, 74, 75, 76], [1, 100], [1, 3, 4] * 5]


def _drafted(tmp: Path, artifact: Path) -> Path:
    from specport.drafting import train_draft
    from tests.fixtures import add_chat_tokenizer

    chat = add_chat_tokenizer(artifact, tmp / "chat")
    data = tmp / "messages.txt"
    data.write_text("\n\n".join(f"say something about {i}" for i in range(20)))
    out = tmp / "eagle"
    train_draft(
        chat, out, data=data, minutes=0.1, sequences=20, new_tokens=12, threads=1,
        progress=False, max_steps=40,
    )  # fmt: skip
    return out


@pytest.fixture(scope="module")
def concat_eagle(tiny_zoo, tmp_path_factory) -> Path:
    return _drafted(tmp_path_factory.mktemp("eagle-concat"), tiny_zoo.artifact("llama"))


def _check_exact(artifact: Path, adaptive: bool | None, method: str = "eagle") -> int:
    import specport

    model = specport.load(artifact, threads=1)
    drafted = 0
    for prompt in PROMPTS:
        plain = model.generate(prompt_ids=prompt, max_new_tokens=24, greedy=True)
        spec = model.generate(
            prompt_ids=prompt,
            max_new_tokens=24,
            greedy=True,
            speculative=method,
            num_draft=3,
            adaptive=adaptive,
        )
        assert list(spec.tokens) == list(plain.tokens), prompt
        drafted += int(spec.metrics["speculative"]["drafted"])
    return drafted


@pytest.mark.parametrize("adaptive", [False, None])
def test_greedy_eagle_equals_plain_greedy_concat(concat_eagle, adaptive):
    drafted = _check_exact(concat_eagle, adaptive)
    if adaptive is False:
        assert drafted > 0  # the head drafted (mostly rejected: it trained for seconds)


@pytest.mark.slow
def test_greedy_eagle_equals_plain_greedy_shared(tiny_zoo, tmp_path):
    drafted = _check_exact(_drafted(tmp_path, tiny_zoo.shared("llama")), False)
    assert drafted > 0


def test_greedy_auto_with_a_head_equals_plain_greedy(concat_eagle):
    """The hybrid (the head, suffix matches, plain steps, chosen per step) is exact too."""
    assert _check_exact(concat_eagle, None, "auto") > 0


def test_the_heads_kv_stays_in_place_across_buffer_growth(concat_eagle, monkeypatch):
    """The fused draft graph takes its attention's lengths, so the head's KV is one buffer
    written in place (``eagle_kv``): a small first buffer that doubles several times during
    a long generation leaves greedy output plain greedy's, with the head drafting all along,
    and the head's KV is never returned by a run."""
    import specport
    from specport.runtime.speculative import eagle_kv

    monkeypatch.setattr(eagle_kv, "START", 4)
    grown: list[int] = []
    allocate = eagle_kv.InPlaceHead._allocate

    def recorded(self: eagle_kv.InPlaceHead, capacity: int) -> None:
        grown.append(capacity)
        allocate(self, capacity)

    monkeypatch.setattr(eagle_kv.InPlaceHead, "_allocate", recorded)
    model = specport.load(concat_eagle, threads=1)
    runs: list[Any] = []
    for prompt in PROMPTS[:2]:
        plain = model.generate(prompt_ids=prompt, max_new_tokens=60, greedy=True)
        spec = model.generate(
            prompt_ids=prompt, max_new_tokens=60, greedy=True, speculative="eagle",
            num_draft=3, adaptive=False,
        )  # fmt: skip
        assert list(spec.tokens) == list(plain.tokens), prompt
        assert int(spec.metrics["speculative"]["drafted"]) > 0
        runs.append(spec)
    assert grown[:1] == [4] and max(grown) >= 64  # 4 -> 8 -> ... past the 60 new tokens
    from specport.runtime.speculative.eagle import _SESSIONS

    session = next(iter(_SESSIONS.values()))["session"]
    assert eagle_kv.takes_lengths(session)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["eagle", "auto"])
def test_sampling_with_the_head_keeps_the_target_distribution(concat_eagle, method, monkeypatch):
    """Joint law of the first two sampled tokens equals the target's, over many seeds: the
    drafts (the head's, or the hybrid's choice) change speed, never the distribution."""
    import specport
    from specport.runtime.engine import step_cost
    from specport.runtime.kv.seq_cache import open_cache
    from specport.runtime.sampler import Sampler, SamplingConfig

    # The hybrid sizes drafts from verify costs measured on this machine; a tiny model's
    # sub-millisecond step measured on a loaded CI machine can price every draft out (the
    # suite once saw no draft in 1,200 seeds). What is tested here is the distribution, so
    # the costs are fixed at a plausible CPU's.
    monkeypatch.setattr(
        step_cost,
        "verify_costs",
        lambda model, max_draft=16: [1.0 + 0.1 * k for k in range(max_draft + 1)],
    )
    model = specport.load(concat_eagle, threads=1)
    ids = [5, 17, 42, 5, 17]  # a repeat: the hybrid has a suffix match to weigh
    cfg = dict(greedy=False, temperature=1.0, top_k=3)
    sampler = Sampler(SamplingConfig(**cfg), model.manifest.vocab_size)  # type: ignore[arg-type]

    def probs(context: list[int]) -> np.ndarray:
        logits = open_cache(model.session, model.manifest).step(context).logits[None]
        return sampler.probs(logits[:, -1])[0]

    p1 = probs(ids)
    expected = {
        (int(a), int(b)): float(p1[a] * q)
        for a in np.flatnonzero(p1)
        for b, q in [(b, probs([*ids, int(a)])[b]) for b in np.flatnonzero(probs([*ids, int(a)]))]
    }
    n, drafted = 1200, 0
    counts: Counter[tuple[int, int]] = Counter()
    for seed in range(n):
        out = model.generate(
            prompt_ids=ids, max_new_tokens=3, speculative=method, num_draft=2, adaptive=False,
            seed=seed, **cfg,
        )  # fmt: skip
        counts[(out.tokens[0], out.tokens[1])] += 1
        drafted += int(out.metrics["speculative"]["drafted"])
    assert drafted > n // 10  # drafts really went through rejection sampling
    assert set(counts) <= set(expected)
    tv = 0.5 * sum(abs(counts[c] / n - q) for c, q in expected.items())
    assert tv < 0.07, (tv, counts, expected)


@pytest.fixture(scope="module")
def tree_eagle(tiny_zoo, tmp_path_factory) -> Path:
    return _drafted(tmp_path_factory.mktemp("eagle-tree"), tiny_zoo.shared("llama", tree_mask=True))


@pytest.mark.parametrize("width", [1, 3])
def test_greedy_eagle_tree_equals_plain_greedy(tree_eagle, width):
    """The head's beam as a token tree, verified in one run through the tree mask: plain
    greedy's tokens, with every path kept (no probability cut) so the tree really branches."""
    import specport
    from specport.runtime.speculative.eagle import make_eagle_proposer
    from specport.runtime.speculative.tree_generator import TreeSpeculativeGenerator

    model = specport.load(tree_eagle, threads=1)
    nodes = 0
    for prompt in PROMPTS:
        plain = model.generate(prompt_ids=prompt, max_new_tokens=24, greedy=True)
        head = make_eagle_proposer(model, tree=True)
        gen = TreeSpeculativeGenerator(
            model.session,
            model.manifest,
            3,
            width,
            candidates=functools.partial(head.tree_paths, min_prob=0.0),
            observer=head.observe_path,
            method="eagle-tree",
        )
        out = gen.generate(prompt, 24, eos_ids=model.manifest.eos_token_ids)
        assert list(out.tokens) == list(plain.tokens), prompt
        nodes += int(out.metrics["speculative"]["drafted"])
        # the public path (probability cut on) is exact too
        api = model.generate(
            prompt_ids=prompt, max_new_tokens=24, greedy=True, speculative="eagle",
            num_draft=3, tree_width=width,
        )  # fmt: skip
        assert list(api.tokens) == list(plain.tokens), prompt
    assert nodes > 0


def test_an_artifact_without_a_head_gets_the_command_that_makes_one(tiny_llama_artifact):
    import specport
    from specport.core.errors import SpecportError

    model = specport.load(tiny_llama_artifact, threads=1)
    with pytest.raises(SpecportError, match="train-draft"):
        model.generate(prompt_ids=[1, 2], max_new_tokens=4, speculative="eagle")


# ---------------------------------------------------------------- the proposer's bookkeeping


class _Session:
    """A fake draft graph: drafts (last input id + 1), records what it was fed."""

    def __init__(self) -> None:
        self.calls: list[dict[str, np.ndarray]] = []

    def run(self, _names: Any, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        self.calls.append(feed)
        ids, past = feed["input_ids"], feed["past_key"]
        s = ids.shape[1]
        present = np.concatenate([past, np.zeros((1, 1, s, 2), np.float32)], 2)
        token = np.array([ids[0, -1] + 1])
        return [token, np.zeros((1, 4)), feed["hidden_in"] * 0 + 1, present, present]


def _proposer() -> tuple[EagleProposer, _Session]:
    cfg = {"hidden": 4, "feature_layers": 3, "kv_heads": 1, "head_dim": 2, "draft_vocab": 8}
    manifest = SimpleNamespace(extra={"eagle": {"graph": "g", "config": {**cfg, "vocab": 16}}})
    session = _Session()
    return EagleProposer(session, manifest), session  # type: ignore[arg-type]


def _features(rows: list[int]) -> dict[str, np.ndarray]:
    """Feature rows whose first value names their context position."""
    f = np.zeros((1, len(rows), 12), np.float32)
    f[0, :, 0] = rows
    return {"eagle_features": f}


def test_features_pair_with_the_following_token_and_drafts_leave_no_kv():
    proposer, session = _proposer()
    context = [10, 11, 12, 13]  # prefill ran 10, 11, 12 (positions 0..2)
    proposer.observe_prefill(_features([0, 1, 2]))
    drafts = proposer.propose([context], 3)
    first = session.calls[0]
    assert first["features"][0, :, 0].tolist() == [2.0]  # only the prefill's last position
    assert first["input_ids"].tolist() == [[13]]  # position 2 pairs with token 3
    assert drafts.row(0) == [14, 15, 16]
    assert proposer.past_key.shape[2] == 1  # the draft positions' KV was dropped
    # the loop verified [13, 14, 15, 16] and accepted 2 (14, 15), bonus 99
    result = SimpleNamespace(accepted=np.array([2]))
    proposer.observe(_features([3, 4, 5, 6]), result)
    context += [14, 15, 99]
    proposer.propose([context], 2)
    catch_up = session.calls[3]
    assert catch_up["features"][0, :, 0].tolist() == [3.0, 4.0, 5.0]  # rows of accepted positions
    assert catch_up["input_ids"].tolist() == [[14, 15, 99]]
    assert proposer.past_key.shape[2] == 4


def test_a_plain_step_between_proposals_keeps_the_pairing():
    proposer, session = _proposer()
    proposer.observe_prefill(_features([0]))
    context = [7, 8]
    proposer.propose([context], 1)
    for pos, tok in ((1, 30), (2, 31)):  # two plain one-token steps (accepted 0 each)
        proposer.observe(_features([pos]), SimpleNamespace(accepted=np.array([0])))
        context.append(tok)
    proposer.propose([context], 1)
    assert session.calls[-1]["input_ids"].tolist() == [[30, 31]]
    assert session.calls[-1]["features"][0, :, 0].tolist() == [1.0, 2.0]


class _TreeSession:
    """A fake draft graph for trees: the same draft distribution after every input (0.6 /
    0.3 / 0.08 / 0.02 over draft rows 0..3), any batch; records the batch of each run."""

    probs = np.array([0.6, 0.3, 0.08, 0.02])

    def __init__(self) -> None:
        self.batches: list[int] = []

    def run(self, _names: Any, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        ids, past = feed["input_ids"], feed["past_key"]
        n, s = ids.shape
        self.batches.append(n)
        present = np.concatenate([past, np.zeros((n, 1, s, 2), np.float32)], 2)
        logits = np.tile(np.log(self.probs), (n, 1))
        return [np.zeros(n, np.int64), logits, feed["hidden_in"] * 0 + 1, present, present]


def test_a_tree_is_the_heads_beam_best_first_cut_below_min_prob():
    cfg = {"hidden": 4, "feature_layers": 3, "kv_heads": 1, "head_dim": 2, "draft_vocab": 4}
    manifest = SimpleNamespace(extra={"eagle": {"graph": "g", "config": {**cfg, "vocab": 16}}})
    session = _TreeSession()
    head = EagleProposer(session, manifest, draft_ids=np.array([10, 11, 12, 13]))  # type: ignore[arg-type]
    head.observe_prefill(_features([0]))
    # depth 1: 10 (0.6), 11 (0.3); depth 2 beam of 2: 10,10 (0.36), 10,11 (0.18)
    assert head.tree_paths([7, 8], depth=2, width=2, min_prob=0.0) == [
        [10], [10, 10], [11], [10, 11]
    ]  # fmt: skip
    assert session.batches == [1, 2]  # one run per depth, the beam batched
    assert head.past_key.shape[2] == 1  # only the real position stays in the head's KV
    head.observe_path(_features([1, 2, 3]), [0, 2])  # the run accepted the root and node 2
    assert head.pending_rows()[:, 0].tolist() == [1.0, 3.0]
    # a cut at 0.2 keeps 10, 11 and 10,10; at 0.7 nothing (a plain step)
    assert head.tree_paths([7, 8, 10, 42], 2, 2, min_prob=0.2) == [[10], [10, 10], [11]]
    head.observe_path(_features([4]), [0])
    assert head.tree_paths([7, 8, 10, 42, 5], 2, 2, min_prob=0.7) == []
