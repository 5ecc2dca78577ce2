"""The draft-cache benchmark runs plain, own-cache and target's-cache drafting (a smoke test:
no timing asserted) and restores the proposer it patches."""

from __future__ import annotations

import pytest

from benchmarks.draft_in_target_kv import measure, table
from specport.runtime.speculative.draft import DraftModelProposer

pytestmark = pytest.mark.slow  # a tiny shared-layout export


def test_each_mode_is_timed_and_only_the_targets_cache_skips_the_prompt(tiny_zoo):
    import specport
    from specport.bench.prompt_sets import BenchPrompt

    model = specport.load(tiny_zoo.shared("llama"), threads=1)
    prompts = [BenchPrompt([5, 6, 7, 8] * 5, "a"), BenchPrompt([9, 3, 4], "b")]
    share, propose = DraftModelProposer.share_target_kv, DraftModelProposer.propose
    rows = measure(model, model, prompts, rounds=2, new_tokens=8, num_draft=3)  # drafts itself
    assert DraftModelProposer.share_target_kv is share and DraftModelProposer.propose is propose
    assert [r["category"] for r in rows] == ["a", "b"]
    for r in rows:
        assert all(len(r[m]["wall"]) == 2 for m in ("plain", "own", "shared"))
        assert r["shared"]["read_per_propose"] == 1.0 < r["own"]["read_per_propose"]
    lines = table(rows).splitlines()
    assert [line.split(" | ")[0] for line in lines[2:]] == ["| a", "| b"]
