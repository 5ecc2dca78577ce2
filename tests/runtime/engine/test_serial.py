"""SerialEngine on a concat-KV artifact: `Model.generate` per request, behind the engine contract."""

from __future__ import annotations

import threading

import pytest

import specport
from specport.runtime.engine.base import Request
from specport.runtime.engine.serial import SerialEngine

PROMPTS = [[1, 74, 75, 76, 90], [1, 100], [1, 5, 6, 7, 8, 9, 10, 11, 12]]


@pytest.fixture(scope="module")
def concat_model(tiny_llama_artifact):
    return specport.load(tiny_llama_artifact, provider="cpu", threads=1)


@pytest.fixture
def engine(concat_model):
    eng = SerialEngine(concat_model)
    yield eng
    eng.close()


def test_concurrent_requests_get_generate_tokens_and_text(engine, concat_model):
    want = [
        concat_model.generate(prompt_ids=p, max_new_tokens=10, ignore_eos=True) for p in PROMPTS
    ]
    results: dict[int, object] = {}

    def client(i: int) -> None:
        handle = engine.submit(Request(PROMPTS[i], 10, ignore_eos=True))
        events = list(handle.events(timeout=60))
        results[i] = (events, handle)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, w in enumerate(want):
        events, handle = results[i]
        assert [t for ev in events for t in ev.token_ids] == w.tokens
        assert "".join(ev.text for ev in events) == w.text
        assert events[-1].finish_reason == "length"
    assert engine.stats()["finished"] == 3


def test_stop_string_and_errors(shared_model):
    """On the shared-KV model (the concat one has no tokenizer, so no text to stop on)."""
    engine = SerialEngine(shared_model)
    full = shared_model.generate(prompt_ids=PROMPTS[2], max_new_tokens=20, ignore_eos=True)
    start = next(
        i
        for i in range(2, len(full.text) - 1)
        if full.text[i : i + 2].isascii() and full.text[i : i + 2].isprintable()
    )
    stop = full.text[start : start + 2]
    got = engine.submit(Request(PROMPTS[2], 20, stop=[stop], ignore_eos=True)).result(timeout=60)
    assert got.finish_reason == "stop" and got.text == full.text[: full.text.index(stop)]
    bad = engine.submit(Request([1, 10_000], 4)).result(timeout=60)
    assert bad.finish_reason == "error" and "vocabulary" in bad.error
    ok = engine.submit(Request(PROMPTS[0], 3, ignore_eos=True)).result(timeout=60)
    assert ok.finish_reason == "length" and len(ok.token_ids) == 3
    engine.close()


def test_cancelled_before_start_and_on_close(concat_model):
    eng = SerialEngine(concat_model)
    first = eng.submit(Request(PROMPTS[0], 100, ignore_eos=True))
    queued = eng.submit(Request(PROMPTS[1], 4, ignore_eos=True))
    queued.cancel()
    assert queued.result(timeout=60).finish_reason == "cancelled"
    assert first.result(timeout=60).finish_reason in ("length", "context")
    late = [eng.submit(Request(PROMPTS[1], 100, ignore_eos=True)) for _ in range(3)]
    eng.close()
    assert late[-1].result(timeout=60).finish_reason == "cancelled"


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculative_requests_equal_plain_greedy(concat_model, tiny_llama_artifact, method):
    """Speculation behind the engine: every request's greedy tokens are plain greedy's."""
    draft = tiny_llama_artifact if method == "draft" else None
    eng = SerialEngine(concat_model, speculative=method, num_draft=3, draft=draft)
    try:
        handles = [eng.submit(Request(p, 12, ignore_eos=True)) for p in PROMPTS]
        for p, handle in zip(PROMPTS, handles):
            want = concat_model.generate(prompt_ids=p, max_new_tokens=12, ignore_eos=True)
            got = handle.result(timeout=120)
            assert got.token_ids == want.tokens and got.finish_reason == "length"
    finally:
        eng.close()
