"""The prompts `specport bench --speculative` decodes: built-in sets, or a user's prompt file.

A prompt file (``specport.core.prompt_files``: MT-bench / Spec-Bench ``turns``, Alpaca /
self-instruct ``instruction``, OpenAI ``messages``, text paragraphs) is rendered with the
artifact's chat template when it has one (the plain text otherwise). Every turn of a
multi-turn record is a prompt of its own, timed like the others: turn 2 follows the model's own
answer to turn 1, and that answer is plain greedy's (decoded once, untimed, up to EOS or the
bench's new tokens). Every exact method makes those same tokens, so every engine and peer gets
the same turn-2 prompt, and it is the conversation a user of any of them would have had.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from specport.core.chat_template import load_chat_template
from specport.core.errors import InputError
from specport.core.prompt_files import PromptRecord, read_prompt_file, select
from specport.samples.chat_prompts import chat_prompts

logger = logging.getLogger(__name__)

# Built-in prompt sets: everyday story openings, and copy-heavy text (repeated passages) where
# prompt lookup can shine. Users pass their own with --prompt or --prompts FILE.
PROMPT_SETS: dict[str, list[str]] = {
    "story": [
        "Once upon a time",
        "Lily and Ben went to the park.",
        "One day, a little boy named Tim",
        "Sue had a big dog.",
        "The sun was shining",
        "Once upon a time, there was a little girl named Lily. She loved to play",
    ],
    "copy": [
        "The cat sat on the mat. The cat sat on the mat. The cat sat on the mat. The cat",
        "Tom had a red ball. Tom had a red ball. Tom had a red ball. Tom had a red ball. Tom",
        "I like cake. I like cake. I like cake. I like cake. I like cake. I",
        "The dog ran and ran and ran and ran and ran and ran and",
    ],
}
# Chat prompt sets (``samples.chat_prompts``): rendered with the artifact's chat template.
CHAT_SETS = ("chat", "chat-question", "chat-instruction", "chat-rewrite", "chat-more")


@dataclass(frozen=True)
class PromptFileChoice:
    """``--prompts FILE`` and what to take from it (``prompt_files.select``)."""

    path: str
    limit: int | None = None  # records per category
    split: str = "all"  # all | tune | eval
    seed: int = 0
    categories: tuple[str, ...] = ()  # only these (all when empty)


@dataclass(frozen=True)
class BenchPrompt:
    ids: list[int]
    category: str | None = None
    turn: int = 1


def chat_prompt_ids(model: Any, prompt_set: str) -> list[list[int]]:
    """The 16 fixed chat prompts (or one kind of them) as the model's chat-template ids."""

    template = load_chat_template(model)
    if template is None:
        raise InputError(
            f"--prompt-set {prompt_set} needs a model with a chat template; use story or copy."
        )
    more = prompt_set == "chat-more"  # the second set, unseen by drafters tuned on the first
    kind = prompt_set.split("-", 1)[1] if "-" in prompt_set and not more else None
    texts = chat_prompts(kind, more=more)
    return [template.render_ids([{"role": "user", "content": t}]) for t in texts]


def set_prompt_ids(model: Any, prompt_set: str) -> list[list[int]]:
    """A built-in set's prompts as ids."""
    if prompt_set in CHAT_SETS:
        return chat_prompt_ids(model, prompt_set)
    if prompt_set not in PROMPT_SETS:
        raise InputError(
            f"unknown prompt set {prompt_set!r}; use one of "
            f"{sorted(PROMPT_SETS) + list(CHAT_SETS)}, --prompt TEXT or --prompts FILE."
        )
    return [model.encode(text) for text in PROMPT_SETS[prompt_set]]


def read_choice(choice: PromptFileChoice) -> tuple[list[PromptRecord], dict[str, Any]]:
    """The records ``choice`` selects and what the report says about them; errors before any
    model loads."""
    pf = read_prompt_file(choice.path)
    records = pf.records
    if choice.categories:
        unknown = sorted(set(choice.categories) - set(pf.categories))
        if unknown:
            have = ", ".join(pf.categories) or "none"
            raise InputError(
                f"--prompts-category {', '.join(unknown)}: not in {choice.path} "
                f"(its categories: {have})."
            )
        records = [r for r in records if r.category in choice.categories]
    kept = select(records, choice.limit, choice.split, choice.seed)
    if not kept:
        raise InputError(
            f"--prompts {choice.path}: no record left after --prompts-split {choice.split}; "
            "use a larger file or --prompts-split all."
        )
    info = {
        "path": choice.path,
        "format": pf.format,
        "records": len(pf.records),
        "selected": len(kept),
        "split": choice.split,
        "seed": choice.seed,
        "limit_per_category": choice.limit,
    }
    return kept, info


def file_prompts(
    model: Any, plain_model: Any, records: Sequence[PromptRecord], max_new_tokens: int
) -> tuple[list[BenchPrompt], str]:
    """Each record's turns as prompt ids (later turns after plain greedy's answers), and how
    they were rendered ("chat template" or "plain text")."""
    template = load_chat_template(model)

    def ids(record: PromptRecord, answers: list[str]) -> list[int]:
        if template is None:
            return list(model.encode(record.text(answers)))
        return template.render_ids(record.messages(answers))

    out: list[BenchPrompt] = []
    for record in records:
        answers: list[str] = []
        for turn in range(len(record.turns)):
            prompt = ids(record, answers)
            out.append(BenchPrompt(prompt, record.category, turn + 1))
            if turn + 1 < len(record.turns):  # the model's own answer, before the next turn
                answer = plain_model.generate(prompt_ids=prompt, max_new_tokens=max_new_tokens)
                answers.append(answer.text.strip())
    return out, "plain text" if template is None else "chat template"
