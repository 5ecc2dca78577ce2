"""The built-in templated distillation collection (`train-draft --messages builtin`)."""

from __future__ import annotations

import hashlib

from specport.samples import chat_prompts as bench
from specport.samples.chat_distill import CORE, prompts

# the first CORE messages, as every earlier release wrote them: a kept training folder of
# `--sequences 768` still matches them, and MTP heads trained on them stay comparable
CORE_DIGEST = "88db5b327befaeb9b46499f95081dab3f936f37f2b28a625b1652b373347c1ef"


def test_the_core_is_unchanged_and_every_message_is_distinct():
    texts = prompts()
    assert hashlib.sha256("\n".join(texts[:CORE]).encode()).hexdigest() == CORE_DIGEST
    assert len(set(texts)) == len(texts) > 4 * CORE


def test_no_evaluation_prompt_or_text_is_in_the_collection():
    texts = prompts()
    evaluation = bench.chat_prompts() + bench.chat_prompts(more=True)
    assert not set(evaluation) & set(texts)
    paragraphs = [
        v for k, v in vars(bench).items() if k.startswith("PARAGRAPH_") and isinstance(v, str)
    ]
    assert len(paragraphs) == 7
    assert not [t for t in texts if any(p in t for p in paragraphs)]
