"""make_engine: batching for shared-KV artifacts, serial otherwise, clear errors for the rest."""

from __future__ import annotations

import pytest

import specport
from specport.core.errors import ArtifactError, InputError
from specport.runtime.engine import make_engine
from specport.runtime.engine.base import Request
from specport.runtime.engine.batching import BatchingEngine
from specport.runtime.engine.serial import SerialEngine


def test_auto_picks_by_layout(shared_model, tiny_llama_artifact):
    concat = specport.load(tiny_llama_artifact, provider="cpu", threads=1)
    for model, kind, want in [
        (shared_model, "auto", BatchingEngine),
        (shared_model, "serial", SerialEngine),
        (concat, "auto", SerialEngine),
    ]:
        eng = make_engine(model, max_batch=2, kind=kind)
        try:
            assert isinstance(eng, want)
        finally:
            eng.close()
    eng = make_engine(shared_model, max_batch=1)
    assert isinstance(eng, SerialEngine)  # one row: nothing to batch
    eng.close()
    with pytest.raises(ArtifactError, match="--kv-layout shared"):
        make_engine(concat, kind="batching")
    with pytest.raises(InputError, match="unknown engine kind"):
        make_engine(shared_model, kind="vllm")


def test_speculative_engine_follows_the_layout(shared_model, tiny_llama_artifact):
    """Concat: the serial engine speculates; shared: the batching engine's rows do."""
    concat = specport.load(tiny_llama_artifact, provider="cpu", threads=1)
    eng = make_engine(concat, kind="auto", speculative="ngram", num_draft=3)
    try:
        assert isinstance(eng, SerialEngine) and eng.stats()["speculative"] == "ngram"
    finally:
        eng.close()
    with pytest.raises(ArtifactError, match="shared-KV"):
        make_engine(concat, kind="batching", speculative="ngram")
    prompt = [1, 5, 9, 5, 9, 5, 9, 2, 7]
    want = shared_model.generate(prompt_ids=prompt, max_new_tokens=12, ignore_eos=True).tokens
    for kind, engine_type in (("auto", BatchingEngine), ("serial", SerialEngine)):
        eng = make_engine(shared_model, kind=kind, speculative="ngram")  # greedy-exact
        try:
            assert isinstance(eng, engine_type)
            got = eng.submit(Request(prompt, 12, ignore_eos=True)).result(timeout=120)
            assert got.token_ids == want
        finally:
            eng.close()
