"""The batching engine speculating with model proposers: a draft model and MTP heads.

Greedy output equals plain greedy for every request, with staggered arrivals and a
cancellation; sampling with a draft model (drafts drawn from the draft's own distribution q,
accepted with min(1, p/q)) keeps plain sampling's law of the first three tokens.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from specport.runtime.engine.base import Request
from specport.runtime.engine.batching import BatchingEngine
from specport.runtime.sampler import SamplingConfig

pytestmark = pytest.mark.slow  # exports three tiny artifacts and trains nothing (~30-60 s)

MAX_LENGTH = 96
PROMPTS = [[5, 17, 42, 9], [1, 3, 4] * 5, [7], [60, 61, 62, 63, 60, 61], [200, 3, 9, 200]]
NEW = [24, 20, 16, 22, 18]


@pytest.fixture(scope="module")
def arts(tmp_path_factory) -> dict[str, object]:

    import specport
    from tests.export_cache import cached_export, cached_mtp
    from tests.fixtures import build_tiny_model

    tmp: Path = tmp_path_factory.mktemp("engine_spec_models")
    src = build_tiny_model("llama", tmp / "src")
    kw = dict(skip_verify=True, progress=False, kv_layout="shared", max_length=MAX_LENGTH)
    cached_export(src, tmp / "target", **kw)
    cached_export(src, tmp / "draft", layers=1, **kw)
    out = {name: specport.load(tmp / name, threads=1) for name in ("target", "draft")}
    cached_mtp(tmp / "target", tmp / "mtp")
    out["mtp"] = specport.load(tmp / "mtp", threads=1)
    return out


@pytest.fixture
def draft_reads(monkeypatch) -> list[tuple[int, int | None]]:
    """(tokens the draft read before drafting, the target row it drafted in) per propose."""
    from specport.runtime.speculative.draft import DraftModelProposer

    seen: list[tuple[int, int | None]] = []
    real = DraftModelProposer.propose

    def propose(self, context, num_draft):
        drafts = real(self, context, num_draft)
        seen.append((self.caught_up, None if self._target is None else self._target[1]))
        return drafts

    monkeypatch.setattr(DraftModelProposer, "propose", propose)
    return seen


@pytest.mark.parametrize("method", ["draft", "mtp"])
def test_model_proposers_staggered_and_cancelled_equal_plain_greedy(arts, method, draft_reads):
    model = arts["mtp"] if method == "mtp" else arts["target"]
    want = [
        model.generate(prompt_ids=p, max_new_tokens=n, ignore_eos=True).tokens  # type: ignore[attr-defined]
        for p, n in zip(PROMPTS, NEW)
    ]
    eng = BatchingEngine(
        model, max_batch=3, speculative=method, draft=arts["draft"], spec_max_rows=8
    )
    try:
        first = eng.submit(Request(PROMPTS[0], NEW[0], ignore_eos=True))
        events = first.events(timeout=60)
        head = next(events)
        doomed = eng.submit(Request(PROMPTS[2], 60, ignore_eos=True))
        rest = [eng.submit(Request(PROMPTS[i], NEW[i], ignore_eos=True)) for i in (1, 3, 4)]
        next(doomed.events(timeout=60))
        doomed.cancel()
        seen = [head, *events]  # under load the first event may already hold every token
        assert [t for ev in seen for t in ev.token_ids] == want[0]
        for i, handle in zip((1, 3, 4), rest):
            assert handle.result(timeout=60).token_ids == want[i], (method, i)
        assert doomed.result(timeout=60).finish_reason == "cancelled"
        stats = eng.stats()
        assert stats["errors"] == 0 and stats["spec_draft_tokens"] > 0
        assert 0 <= stats["spec_accepted_tokens"] <= stats["spec_draft_tokens"]
        if method == "draft":  # cut from the target: it drafts in its request's own KV row
            # (rebound each step, as rows move) and never reads a prompt
            assert draft_reads and all(row is not None for _, row in draft_reads)
            assert max(read for read, _ in draft_reads) == 1
    finally:
        eng.close()


def test_draft_model_sampling_keeps_the_plain_distribution(arts):
    """Joint law of the first three sampled tokens, 400 seeds each: total variation < 0.15."""
    model = arts["target"]
    plain = BatchingEngine(model, max_batch=1)
    spec = BatchingEngine(model, max_batch=1, speculative="draft", draft=arts["draft"], num_draft=2)
    prompt = PROMPTS[0]
    try:
        counts = []
        for eng in (plain, spec):
            seen: Counter[tuple[int, ...]] = Counter()
            for seed in range(400):
                cfg = SamplingConfig(greedy=False, temperature=1.0, top_k=2, seed=seed)
                ev = eng.submit(Request(prompt, 3, sampling=cfg, ignore_eos=True)).result(60)
                seen[tuple(ev.token_ids)] += 1
            counts.append(seen)
        stats = spec.stats()
        assert stats["spec_draft_tokens"] >= 400  # every request drafted
        assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
        keys = set(counts[0]) | set(counts[1])
        tv = sum(abs(counts[0][k] - counts[1][k]) for k in keys) / 800
        assert tv < 0.15, (tv, counts)
    finally:
        plain.close()
        spec.close()


def test_a_draft_path_opens_with_the_targets_threads_and_spinning(arts):
    """A draft given as a path runs on the target's threads and spinning choice: with
    onnxruntime's defaults it took a pool of one thread per core beside the target's."""
    import specport

    target = specport.load(arts["target"].path, threads=1, allow_spinning=False)
    draft = target.draft_model(arts["draft"].path)
    assert draft is not None and draft.session_config is not None
    assert draft.session_config.intra_op_threads == 1
    assert draft.session_config.resolved_spinning() is False
    assert draft.session.get_session_options().intra_op_num_threads == 1


@pytest.mark.parametrize("spin", [True, False])
def test_spinning_pools_stop_between_runs_so_a_draft_and_its_target_take_turns(arts, spin):
    """A draft and its target run in turn, each session with its own pool: a pool left spinning
    after its run took the cores from the other session (draft speculation at 0.54-0.61x plain
    on 2 cores). Spinning sessions spin between ops only; sessions that never spin are left
    as they are."""
    import specport

    target = specport.load(arts["target"].path, threads=2, allow_spinning=spin)
    draft = target.draft_model(arts["draft"].path)
    assert draft is not None
    for model in (target, draft):
        options = model.session.get_session_options()
        spinning = options.get_session_config_entry("session.intra_op.allow_spinning")
        assert spinning == ("1" if spin else "0")
        if spin:
            assert options.get_session_config_entry("session.force_spinning_stop") == "1"
        else:
            with pytest.raises(RuntimeError, match="force_spinning_stop"):
                options.get_session_config_entry("session.force_spinning_stop")
