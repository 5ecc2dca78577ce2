"""What a draft head learns from: the model's own answers, or the target read over real text.

Two kinds of training sequence, both run through the target once for their features and the
target's next-token distribution at every position (``eagle_cache``):

* ``answers``: a prompt under the chat template and the model's own greedy answer, decoded by
  the batched engine (``generate_batch``: one batched run per step for 32 prompts). What the
  head will draft at runtime, exactly, but decoding costs a target step per token.
* ``text``: a prompt and a written answer (an instruction collection's reference output, a
  conversation's assistant turn), or a plain paragraph, read by prefill alone (teacher-forced:
  no generation). The labels are still the target's own choices and distribution at every
  position, over text it did not write; a position costs a share of one prefill run instead
  of a decode step.

``mixed`` trains on both: the answers to part of the prompts and the written text of all.

``read_examples`` takes the records of a prompt file (``specport.core.prompt_files``, the reader
``bench --prompts`` uses: instruction / messages / conversations / turns records or plain
paragraphs) with the answer each one wrote, if any.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specport.core.prompt_files import read_prompt_file, select

logger = logging.getLogger(__name__)

KINDS = ("answers", "text", "mixed")


@dataclass(frozen=True)
class Example:
    """A user message and, when the file has one, a written answer to it."""

    prompt: str
    answer: str | None = None
    chat: bool = True  # False: plain text, read as it is (no chat template)


def read_examples(path: str | Path, split: str = "all") -> list[Example]:
    """The examples in ``path`` (a prompt file, see the module doc), in file order: each
    record's first request with its written answer; ``split`` "tune" / "eval" keeps the seeded
    half ``bench --prompts-split`` keeps (``prompt_files.select``)."""
    records = select(read_prompt_file(path, "--data").records, split=split)
    return [Example(r.turns[0].strip(), r.answer, r.chat) for r in records]


def text_sequences(
    examples: Sequence[Example],
    render: Callable[[str], list[int]] | None,
    encode: Callable[[str], list[int]],
    new_tokens: int,
    end: Sequence[int] = (),
) -> tuple[list[list[int]], list[int]]:
    """(token ids, prompt length) of each example read as text, for ``build_cache``.

    An example with an answer: ``render`` (the prompt under the chat template, with the
    assistant's header) followed by the answer's tokens and ``end`` (the template's end of turn),
    cut to ``new_tokens`` answer tokens as the model's own answers are; the head learns the
    answer's positions. A plain paragraph (or any example without a chat template): its first
    ``new_tokens`` + 1 tokens, all learned (prompt length 1: the first token has no context).
    Examples with no answer and a chat template are skipped (they are prompts to answer)."""
    seqs: list[list[int]] = []
    starts: list[int] = []
    for ex in examples:
        if ex.chat and render is not None:
            if not ex.answer:
                continue
            prompt = render(ex.prompt)
            answer = (encode(ex.answer) + list(end))[:new_tokens]
            if answer:
                seqs.append(prompt + answer)
                starts.append(len(prompt))
        else:
            ids = encode(ex.prompt if ex.answer is None else f"{ex.prompt}\n\n{ex.answer}")
            ids = ids[: new_tokens + 1]
            if len(ids) >= 2:
                seqs.append(ids)
                starts.append(1)
    return seqs, starts


def end_of_turn(template: Any, encode: Callable[[str], list[int]]) -> list[int]:
    """The token(s) the chat template puts after an assistant's text (ChatML's ``<|im_end|>``),
    which the model's own answers end with: a written answer gets them too. [] when the
    template renders the answer otherwise than its prompt followed by the answer's tokens."""
    user = [{"role": "user", "content": "Hi"}]
    word = "Hello"
    prompt = template.render_ids(user)
    both = template.render_ids([*user, {"role": "assistant", "content": word}])
    answer = encode(word)
    if both[: len(prompt)] != prompt or both[len(prompt) : len(prompt) + len(answer)] != answer:
        return []
    return both[len(prompt) + len(answer) : len(prompt) + len(answer) + 1]
