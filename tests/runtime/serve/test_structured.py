"""Structured outputs through the official `openai` client: response_format json_schema /
json_object and vLLM's guided_regex / guided_choice / guided_grammar, on both engines, greedy
and sampled. stories260K knows nothing of JSON, so an answer that parses and validates is the
grammar's doing."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import openai
import pytest

from tests.runtime.serve.helpers import openai_client

pytestmark = [pytest.mark.slow, pytest.mark.shared]  # the serial cases serve stories260K
pytest.importorskip("xgrammar", reason="structured outputs need specport[structured]")

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "size": {"enum": [1, 2, 3]},
    },
    "required": ["ok", "color", "size"],
    "additionalProperties": False,
}


@pytest.fixture(params=["serial", "batching"])
def server(request):
    """stories260K on the serial engine, or the tiny Llama with a byte tokenizer on the
    batching engine; both answer to the model name "s260" here."""
    if request.param == "serial":
        return request.getfixturevalue("stories")[1]
    server = request.getfixturevalue("bytes_batching")[1]
    server.app.state.specport.served.name = "s260"
    return server


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_answer_parses_and_validates(server, temperature):
    client = openai_client(server)
    out = client.chat.completions.create(
        model="s260",
        messages=[{"role": "user", "content": "Describe the ball."}],
        max_tokens=60,
        temperature=temperature,
        seed=5,
        response_format={"type": "json_schema", "json_schema": {"name": "ball", "schema": SCHEMA}},
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_regex_choice_and_grammar(server):
    client = openai_client(server)
    out = client.completions.create(
        model="s260",
        prompt="Once upon a time",
        max_tokens=20,
        temperature=0.8,
        seed=1,
        n=3,
        extra_body={"guided_regex": "[a-z]{3}-[0-9]{2}"},
    )
    for c in out.choices:
        assert re.fullmatch("[a-z]{3}-[0-9]{2}", c.text), c.text
    out = client.completions.create(
        model="s260",
        prompt="The cat was",
        max_tokens=10,
        temperature=0,
        extra_body={"guided_choice": ["happy", "sad", "very sleepy"]},
    )
    assert out.choices[0].text in ("happy", "sad", "very sleepy")
    grammar = 'root ::= "Lily " ("ran" | "sang") " " [0-9]'
    out = client.completions.create(
        model="s260",
        prompt="Once",
        max_tokens=10,
        temperature=0,
        extra_body={"guided_grammar": grammar},
    )
    assert re.fullmatch("Lily (ran|sang) [0-9]", out.choices[0].text), out.choices[0].text
    # streamed, the pieces add up to a valid answer too
    text = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="s260",
            prompt="Once",
            max_tokens=20,
            temperature=0,
            stream=True,
            extra_body={"guided_regex": "[a-z]{3}-[0-9]{2}"},
        )
        if c.choices
    )
    assert re.fullmatch("[a-z]{3}-[0-9]{2}", text), text


def test_json_object_and_bad_constraints(server):
    client = openai_client(server)
    out = client.completions.create(
        model="s260",
        prompt="{",
        max_tokens=40,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out.choices[0].text), dict)
    else:  # a JSON object the budget cut short still starts as one
        assert out.choices[0].text.startswith("{")
    with pytest.raises(openai.BadRequestError, match="could not be compiled"):
        client.completions.create(
            model="s260", prompt="x", max_tokens=4, extra_body={"guided_regex": "[a-"}
        )
    with pytest.raises(openai.BadRequestError, match="one structured-output constraint"):
        client.completions.create(
            model="s260",
            prompt="x",
            max_tokens=4,
            extra_body={"guided_regex": "a", "guided_choice": ["b"]},
        )


def test_mask_allows_exactly_the_grammar(bytes_batching):
    """The mask is the grammar: after `{"ok":` only `true` / `false` prefixes are allowed."""
    model, server = bytes_batching
    from specport.runtime.grammar import GrammarCompiler

    g = GrammarCompiler(model.tokenizer, model.manifest.vocab_size, model.manifest.eos_token_ids)
    c = g.constraint(g.compile("json_schema", SCHEMA))
    for t in model.tokenizer.encode('{"ok": ', add_special_tokens=False).ids:
        assert c.accept(t)
    allowed = np.flatnonzero(c.allowed())
    texts = {model.tokenizer.decode([int(t)]) for t in allowed}
    assert texts == {"t", "f"}, texts
    assert not c.accept(model.tokenizer.encode("1", add_special_tokens=False).ids[-1])


def test_speculative_greedy_json_equals_plain(stories):
    """`serve --speculative ngram` with a json_schema, greedy: the same answer as the plain
    engine's, token for token, and it validates; drafts were made and some rejected by it."""
    from specport.runtime.engine import make_engine
    from tests.runtime.serve.helpers import serve

    model, plain = stories
    engine = make_engine(model, kind="serial", speculative="ngram", num_draft=3)
    spec = serve(model, engine, model_name="s260")
    body = {
        "model": "s260",
        "prompt": "Once upon a time",
        "max_tokens": 60,
        "temperature": 0,
        "extra_body": {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": SCHEMA},
            }
        },
    }
    try:
        want = openai_client(plain).completions.create(**body).choices[0]
        got = openai_client(spec).completions.create(**body).choices[0]
        assert got.text == want.text and got.finish_reason == want.finish_reason == "stop"
        jsonschema.validate(json.loads(got.text), SCHEMA)
        stats = engine.stats()
        assert stats["spec_draft_tokens"] > stats["spec_accepted_tokens"], stats
        with pytest.raises(openai.BadRequestError, match="temperature 0"):
            openai_client(spec).completions.create(**{**body, "temperature": 0.7})
    finally:
        spec.stop()
        engine.close()


def test_a_draft_the_grammar_forbids_is_rejected(bytes_batching):
    """Even when the model's own argmax: the accepted tokens are the masked argmax's."""
    from specport.runtime.grammar import GrammarCompiler
    from specport.runtime.sampler import Sampler, SamplingConfig
    from specport.runtime.speculative.base import Drafts
    from specport.runtime.speculative.verify import constrained_greedy_verify

    model, _ = bytes_batching
    m = model.manifest
    g = GrammarCompiler(model.tokenizer, m.vocab_size, m.eos_token_ids)
    digit, letter = (model.tokenizer.token_to_id(ch) for ch in ("7", "a"))
    logits = np.zeros((1, 3, m.vocab_size), np.float32)
    logits[0, :, letter] = 10.0  # the model wants "a" everywhere; the grammar wants digits
    logits[0, :, digit] = 5.0
    constraint = g.constraint(g.compile("regex", "[0-9]{4}"))
    sampler = Sampler(SamplingConfig(greedy=True, constraint=constraint), m.vocab_size)
    drafts = Drafts(np.array([[letter, digit]]), np.array([2]))
    out = constrained_greedy_verify(drafts, logits, sampler, [1])
    assert int(out.accepted[0]) == 0 and out.tokens == [[digit]]  # "a" rejected
    drafts = Drafts(np.array([[digit, digit]]), np.array([2]))
    out = constrained_greedy_verify(drafts, logits, sampler, [1])
    assert int(out.accepted[0]) == 2 and out.tokens == [[digit] * 3]  # all taken, plus a bonus
