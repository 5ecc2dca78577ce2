"""What OpenAI users reach for beyond a plain completion, through the official `openai` client:
`n`, `logprobs` / `top_logprobs`, `echo`, presence / frequency penalties, `logit_bias`.

Token-exact against references computed outside the server: `Model.generate` with the same
`SamplingConfig`, and the model's own logits from a plain onnxruntime run of the unfused
(concat-layout) export of the same weights.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from specport.runtime.sampler import SamplingConfig
from tests.runtime.serve.helpers import call, openai_client, state

PROMPT = [1, 17, 42, 99, 5]


def _logits(model: Any, ids: list[int]) -> np.ndarray:
    """[len(ids), V] logits of the concat-layout `model` over `ids` (empty past, one run)."""
    m = model.manifest
    feeds: dict[str, Any] = {
        "input_ids": np.array([ids], dtype=np.int64),
        "attention_mask": np.ones((1, len(ids)), dtype=np.int64),
        "position_ids": np.arange(len(ids))[None],
    }
    for (k, v), h, kd, vd in zip(m.kv.inputs, m.kv.num_heads, m.kv.key_dim, m.kv.value_dim):
        feeds[k] = np.zeros((1, h, 0, kd), np.float32)
        feeds[v] = np.zeros((1, h, 0, vd), np.float32)
    return model.session.run(None, feeds)[0][0]


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x - (
        x.max(-1, keepdims=True)
        + np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True))
    )


@pytest.mark.slow
def test_logprobs_are_the_models_log_softmax(batching, tiny_model):
    model, server = batching
    client = openai_client(server)
    name = model.path.name
    out = client.completions.create(
        model=name,
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    choice = out.choices[0]
    tokens = choice.token_ids
    ref = _log_softmax(_logits(tiny_model, PROMPT + tokens[:-1]))[len(PROMPT) - 1 :]
    lp = choice.logprobs
    assert lp.tokens == [f"token_id:{t}" for t in tokens]
    np.testing.assert_allclose(lp.token_logprobs, ref[np.arange(8), tokens], atol=2e-4)
    for i, top in enumerate(lp.top_logprobs):
        best = np.argsort(-ref[i])[:3]
        assert list(top) == [f"token_id:{t}" for t in best]  # best first; greedy: the chosen one
        np.testing.assert_allclose(list(top.values()), ref[i, best], atol=2e-4)
    # sampling transforms do not change what is reported: the raw model's log-softmax
    hot = client.completions.create(
        model=name,
        prompt=PROMPT,
        max_tokens=4,
        temperature=1.7,
        seed=3,
        logprobs=0,
        extra_body={"ignore_eos": True, "repetition_penalty": 1.3},
    )
    ht = hot.choices[0].token_ids
    want = _log_softmax(_logits(tiny_model, PROMPT + ht[:-1]))[len(PROMPT) - 1 :]
    np.testing.assert_allclose(
        hot.choices[0].logprobs.token_logprobs, want[np.arange(4), ht], atol=2e-4
    )
    # chat shape, via streaming too
    events = [
        c
        for c in client.completions.create(
            model=name,
            prompt=PROMPT,
            max_tokens=8,
            temperature=0,
            logprobs=3,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        if c.choices and c.choices[0].logprobs
    ]
    streamed = [x for c in events for x in c.choices[0].logprobs.token_logprobs]
    np.testing.assert_allclose(streamed, lp.token_logprobs, atol=2e-4)


@pytest.mark.slow
def test_n_choices_share_the_prompt(batching):
    model, server = batching
    client = openai_client(server)
    prompt = [1, *range(30, 90)]  # 61 tokens: the other choices copy its KV
    hits = state(server).engine.stats()["prefix_cache_saved_tokens"]
    greedy = client.completions.create(
        model=model.path.name,
        prompt=prompt,
        max_tokens=6,
        temperature=0,
        n=3,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    want = model.generate(prompt_ids=prompt, max_new_tokens=6, ignore_eos=True).tokens
    assert all(c.token_ids == want for c in greedy.choices)
    assert greedy.usage.completion_tokens == 18 and greedy.usage.prompt_tokens == len(prompt)
    saved = state(server).engine.stats()["prefix_cache_saved_tokens"] - hits
    assert saved >= 2 * (len(prompt) - 1)  # choices 1 and 2 did not prefill the prompt again
    sampled = client.completions.create(
        model=model.path.name,
        prompt=prompt,
        max_tokens=12,
        temperature=1.0,
        n=4,
        seed=11,
        extra_body={"ignore_eos": True},
    )
    seqs = [tuple(c.token_ids) for c in sampled.choices]
    assert len(set(seqs)) > 1  # each choice its own random stream
    again = client.completions.create(
        model=model.path.name,
        prompt=prompt,
        max_tokens=12,
        temperature=1.0,
        n=4,
        seed=11,
        extra_body={"ignore_eos": True},
    )
    assert [tuple(c.token_ids) for c in again.choices] == seqs  # seeded: reproducible
    # streamed: every choice's chunks carry its index, each ends with its own finish_reason
    per: dict[int, list[int]] = {}
    finished = set()
    for chunk in client.completions.create(
        model=model.path.name,
        prompt=prompt,
        max_tokens=6,
        temperature=0,
        n=2,
        stream=True,
        extra_body={"ignore_eos": True},
    ):
        c = chunk.choices[0]
        per.setdefault(c.index, []).extend(getattr(c, "token_ids", None) or [])
        if c.finish_reason:
            finished.add(c.index)
    assert per == {0: want, 1: want} and finished == {0, 1}


@pytest.mark.slow
def test_penalties_and_logit_bias_equal_the_sampler(batching, tiny_model):
    model, server = batching
    client = openai_client(server)
    name = model.path.name
    for kwargs in (
        {"presence_penalty": 1.5},
        {"frequency_penalty": 0.8},
        {"presence_penalty": -0.5, "frequency_penalty": 1.2},
    ):
        out = client.completions.create(
            model=name,
            prompt=PROMPT,
            max_tokens=16,
            temperature=0,
            extra_body={"ignore_eos": True},
            **kwargs,
        )
        cfg = SamplingConfig(greedy=True, **kwargs)
        want = tiny_model.generate(
            prompt_ids=PROMPT, max_new_tokens=16, ignore_eos=True, sampling=cfg
        )
        assert out.choices[0].token_ids == want.tokens, kwargs
    plain = tiny_model.generate(prompt_ids=PROMPT, max_new_tokens=16, ignore_eos=True).tokens
    assert want.tokens != plain  # the penalties changed the answer
    out = client.completions.create(
        model=name,
        prompt=PROMPT,
        max_tokens=5,
        temperature=0,
        logit_bias={"77": 100},
        extra_body={"ignore_eos": True},
    )
    assert out.choices[0].token_ids == [77] * 5
    # the serial engine applies them the same way
    status, body = call(
        _serial(tiny_model),
        "POST",
        "/v1/completions",
        {
            "prompt": PROMPT,
            "max_tokens": 5,
            "temperature": 0,
            "logit_bias": {"77": 100},
            "ignore_eos": True,
        },
    )
    assert status == 200 and body["choices"][0]["token_ids"] == [77] * 5


_SERVERS: list[Any] = []


def _serial(model: Any) -> Any:
    from specport.runtime.engine import make_engine
    from tests.runtime.serve.helpers import serve

    if not _SERVERS:
        engine = make_engine(model, kind="serial")
        _SERVERS.append((serve(model, engine), engine))
    return _SERVERS[0][0]


@pytest.fixture(scope="module", autouse=True)
def _close_serial():
    yield
    for server, engine in _SERVERS:
        server.stop()
        engine.close()


def _check_logprobs(model: Any, choice: Any, k: int) -> None:
    """`choice.logprobs` are the model's log-softmax before each of its tokens (and the top k)."""
    tokens = choice.token_ids
    ref = _log_softmax(_logits(model, PROMPT + tokens[:-1]))[len(PROMPT) - 1 :]
    lp = choice.logprobs
    assert lp.tokens == [f"token_id:{t}" for t in tokens]
    np.testing.assert_allclose(lp.token_logprobs, ref[np.arange(len(tokens)), tokens], atol=2e-4)
    for i, top in enumerate(lp.top_logprobs):
        best = np.argsort(-ref[i])[:k]
        assert list(top) == [f"token_id:{t}" for t in best]
        np.testing.assert_allclose(list(top.values()), ref[i, best], atol=2e-4)


@pytest.mark.parametrize("speculative", [None, "ngram"])
def test_serial_engine_logprobs(tiny_model, speculative):
    """The serial engine reports the same logprobs as the batching engine: the model's
    log-softmax at each generated token, under speculative decoding too (the target model's,
    for every accepted token, greedy and sampled), whole and streamed."""
    from specport.runtime.engine import make_engine
    from tests.runtime.serve.helpers import serve

    engine = make_engine(tiny_model, kind="serial", speculative=speculative, num_draft=3)
    server = serve(tiny_model, engine, model_name="tiny")
    try:
        client = openai_client(server)
        args: dict[str, Any] = {"model": "tiny", "prompt": PROMPT, "max_tokens": 24}
        args["extra_body"] = {"ignore_eos": True}
        out = client.completions.create(**args, temperature=0, logprobs=3)
        want = tiny_model.generate(prompt_ids=PROMPT, max_new_tokens=24, ignore_eos=True).tokens
        assert out.choices[0].token_ids == want
        _check_logprobs(tiny_model, out.choices[0], 3)
        hot = client.completions.create(**args, temperature=1.5, seed=7, logprobs=1)
        _check_logprobs(tiny_model, hot.choices[0], 1)
        streamed = [
            x
            for c in client.completions.create(**args, temperature=0, logprobs=3, stream=True)
            if c.choices and c.choices[0].logprobs
            for x in c.choices[0].logprobs.token_logprobs
        ]
        np.testing.assert_allclose(streamed, out.choices[0].logprobs.token_logprobs, atol=1e-6)
        if speculative:
            assert engine.stats()["spec_accepted_tokens"] > 0  # drafts were accepted
    finally:
        server.stop()
        engine.close()


@pytest.mark.slow
@pytest.mark.shared
def test_echo(stories):
    model, server = stories
    client = openai_client(server)
    out = client.completions.create(
        model="s260", prompt="Once upon a time", max_tokens=12, temperature=0, echo=True
    )
    plain = client.completions.create(
        model="s260", prompt="Once upon a time", max_tokens=12, temperature=0
    )
    assert out.choices[0].text == "Once upon a time" + plain.choices[0].text
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="s260",
            prompt="Once upon a time",
            max_tokens=12,
            temperature=0,
            echo=True,
            stream=True,
        )
        if c.choices
    )
    assert streamed == out.choices[0].text
