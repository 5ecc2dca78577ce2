"""The draft-bound benchmark: its bound is the formula on its page, and a model drafting for
itself agrees with its own greedy answers everywhere."""

from __future__ import annotations

import pytest

from benchmarks.draft_ceiling import agreement, bound, greedy_answers


def test_bound_is_tokens_per_step_over_step_cost():
    # verify costs by run width (K drafts: width K + 1). p = 0.5, d = 0.1: K = 1 gives
    # 1.5 / (1.2 + 0.1) = 1.154, K = 2 gives 1.75 / (1.3 + 0.2) = 1.167, K = 4 gives
    # 1.9375 / (1.4 + 0.4) = 1.076
    k, value = bound(0.5, 0.1, {1: 1.0, 2: 1.2, 3: 1.3, 5: 1.4})
    assert k == 2 and value == pytest.approx(1.75 / 1.5)
    assert bound(0.0, 0.5, {1: 1.0, 2: 1.1}) == (0, 1.0)  # a draft never right never pays


@pytest.mark.slow  # a tiny shared-layout export
def test_a_model_agrees_with_its_own_greedy_answers(tiny_zoo):
    import specport
    from specport.bench.prompt_sets import BenchPrompt

    model = specport.load(tiny_zoo.shared("llama"), threads=1)
    prompts = [BenchPrompt([5, 6, 7, 8] * 3, "a"), BenchPrompt([9, 3, 4], "b")]
    answers = greedy_answers(model, prompts)
    assert all(len(answer) > 0 for _, answer in answers)
    assert agreement([model], answers)[model.path.name] == {"a": 1.0, "b": 1.0, "all": 1.0}
