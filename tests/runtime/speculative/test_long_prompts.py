"""Long prompts (a ~3,000-character article to summarise, a passage to answer from) at every
method: greedy speculative tokens equal plain greedy's, chains and token trees alike.

Real requests are long (Spec-Bench's summarisation and retrieval prompts have a median of about
3,000 characters); the prompt then fills most of the KV cache before the first draft, prompt
lookup finds many matches, and a drafter's own cache starts far from position 0. A tiny Llama
with a byte-level tokenizer (one token per byte: ~3,000 prompt tokens) and a 4,096-token context
carries every drafter: untrained MTP heads, a briefly trained EAGLE head, and itself as the draft
model.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow  # an export, MTP heads and a seconds-long EAGLE training

NEW = 24
SENTENCES = [
    "The river authority said on Tuesday that the new flood barrier near Marlow had held.",
    "Engineers had worried that the spring rains would test the barrier before it was finished.",
    "Residents of the lower town were asked to move their cars away from the riverbank.",
    "Mayor Ellen Hart thanked the volunteers who filled sandbags through the night.",
    "The barrier cost 14 million pounds and took three years to build.",
    "Critics argued that the money should have gone to the bridge on the northern road.",
    "The authority will publish a full report on the flood in the autumn.",
    "Farmers upstream said their fields were still under water on Wednesday morning.",
    "A spokesman for the authority said the river level had fallen by half a metre.",
    "Schools in the lower town reopened after two days, with buses on a new route.",
]


def _article(chars: int = 3000, seed: int = 0) -> str:
    """A news article of about ``chars`` characters: paragraphs of shuffled sentences, with
    the names and figures an article repeats."""
    rng = random.Random(seed)
    paragraphs, size = [], 0
    while size < chars:
        para = " ".join(rng.sample(SENTENCES, 4))
        paragraphs.append(para)
        size += len(para) + 2
    return "\n\n".join(paragraphs)


PROMPTS = {
    "summarise": "Summarise the following article in three sentences.\n\n" + _article(),
    "answer": (
        "Answer the question from the passage.\n\nPassage: "
        + _article(seed=1)
        + "\n\nQuestion: How much did the barrier cost, and who thanked the volunteers?"
        + "\nAnswer:"
    ),
}

# (method, tree width, which artifact drafts): every method a user can pick, chains and trees
CASES = [
    ("ngram", 1, "base"),
    ("suffix", 1, "base"),
    ("auto", 1, "base"),
    ("draft", 1, "base"),
    ("auto", 1, "draft"),  # auto with a draft model (the base artifact drafting for itself)
    ("mtp", 1, "mtp"),
    ("auto", 1, "mtp"),
    ("eagle", 1, "eagle"),
    ("auto", 1, "eagle"),
    ("ngram", 3, "base"),
    ("mtp", 3, "mtp"),
    ("eagle", 3, "eagle"),
]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Any]:
    import specport
    from specport.drafting import train_draft
    from tests.export_cache import cached_export, cached_mtp
    from tests.fixtures import TINY, make_llama

    tmp: Path = tmp_path_factory.mktemp("long")
    hf = make_llama(tmp / "hf", context_length=4096, initializer_range=0.2, **TINY)  # type: ignore[arg-type]
    cached_export(hf, tmp / "base", tree_mask=True, skip_verify=True, progress=False)
    cached_mtp(tmp / "base", tmp / "mtp", heads=2, seed=0)
    data = tmp / "messages.txt"
    data.write_text("\n\n".join(f"say something about {i}" for i in range(20)))
    train_draft(
        tmp / "base", tmp / "eagle", data=data, minutes=0.1, sequences=20, new_tokens=12,
        threads=1, progress=False, max_steps=40,
    )  # fmt: skip
    return {
        "base": specport.load(tmp / "base", threads=1),
        "mtp": specport.load(tmp / "mtp", threads=1, mtp_branch=True),
        "eagle": specport.load(tmp / "eagle", threads=1),
    }


@pytest.fixture(scope="module")
def plain(models) -> dict[str, list[int]]:
    base = models["base"]
    out = {}
    for name, text in PROMPTS.items():
        ids = base.encode(text)
        assert len(ids) > 2900  # the prompt really is long (one token per byte)
        out[name] = base.generate(prompt_ids=ids, max_new_tokens=NEW, ignore_eos=True).tokens
    return out


@pytest.mark.parametrize("prompt", list(PROMPTS))
@pytest.mark.parametrize(
    "method, width, drafter",
    CASES,
    ids=[f"{m}-{d}" + ("-tree" if w > 1 else "") for m, w, d in CASES],
)
def test_long_prompt_speculation_equals_plain_greedy(models, plain, prompt, method, width, drafter):
    model = models["base" if drafter == "draft" else drafter]
    ids = models["base"].encode(PROMPTS[prompt])
    kw: dict[str, Any] = {"draft": models["base"]} if "draft" in (method, drafter) else {}
    got = model.generate(
        prompt_ids=ids,
        max_new_tokens=NEW,
        ignore_eos=True,
        speculative=method,
        num_draft=2,  # the MTP artifact has two heads
        tree_width=width,
        adaptive=False if method != "auto" else None,
        **kw,
    )
    assert got.tokens == plain[prompt], (method, width, drafter, prompt)
    spec = got.metrics["speculative"]
    assert spec["steps"] >= 1
    if method in ("ngram", "draft", "mtp", "eagle") and width == 1:
        assert spec["drafted"] > 0  # it drafted over the long context, not only decoded plainly
    if drafter == "draft":  # a 24-token answer never repays the draft's reading of the prompt
        assert "model" not in spec["choices"], spec["choices"]
