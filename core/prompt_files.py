"""Prompt files: the request collections people have, read one way by the bench and train-draft.

A benchmark that only runs prompts we wrote measures what we wrote; these are the formats the
field's request sets come in, each read into the same ``PromptRecord``:

* JSON lines (or a JSON array) whose records have ``turns`` (MT-bench, Spec-Bench): a list of
  user messages, each answered before the next is sent;
* ``instruction`` with an optional ``input`` (Alpaca), or ``instances`` whose first ``input``
  is used (self-instruct's seed tasks): the instruction, then the input on its own paragraph;
* ``messages`` (OpenAI chat) or ``conversations`` (ShareGPT: ``from`` human / gpt / system
  and ``value``): the conversation up to its last user message is the request (earlier
  assistant messages are kept as written; the one after it is the written answer);
* ``prompt`` (or ``text``): one message;
* anything else is plain text, one message per blank-line separated paragraph.

A record also keeps the answer the file wrote for its first request, when it has one
(``output`` / ``response``, an instance's ``output``, the assistant message after the request,
MT-bench's ``reference``): the bench sends the request and ignores it; ``train-draft --data-kind
text`` has the target read it (``train.draft_data``). Paragraphs (and ``text`` records) are
``chat=False``: text as it is, which training reads without the chat template.

A record's ``category`` (Spec-Bench's six tasks, MT-bench's eight) becomes a row group of its
own in the bench. ``select`` takes at most N records per category and, for keeping tuning and
evaluation apart, a seeded half of them: a record's side follows from its own text and the
seed, so it stays on that side when the file grows or is reordered.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specport.core.documents import split_documents
from specport.core.errors import InputError

SPLITS = ("all", "tune", "eval")
EVAL_FRACTION = 0.5  # the share of each category ``select(split="eval")`` keeps
FORMATS = ("turns", "instruction", "messages", "prompt", "paragraphs")
ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
}


@dataclass(frozen=True)
class PromptRecord:
    """One request: user ``turns`` answered one after another, after fixed ``context``.

    ``context`` holds messages given as they are (a system message, an exchange the file
    wrote out); ``turns`` are the user messages the model answers, each after its own answer
    to the one before (``messages``)."""

    turns: tuple[str, ...]
    context: tuple[tuple[str, str], ...] = ()  # (role, content) before the first turn
    category: str | None = None
    id: str | None = None
    answer: str | None = None  # the file's written answer to the first turn, if any
    chat: bool = True  # False: plain text (a paragraph), not a message to a chat model

    def messages(self, answers: Sequence[str] = ()) -> list[dict[str, str]]:
        """The conversation that asks turn ``len(answers)``: the context, then each earlier
        turn followed by its answer, then that turn."""
        if len(answers) >= len(self.turns):
            raise ValueError(f"{len(answers)} answers for {len(self.turns)} turns")
        out = [{"role": role, "content": content} for role, content in self.context]
        for turn, answer in zip(self.turns, answers):
            out += [{"role": "user", "content": turn}, {"role": "assistant", "content": answer}]
        return [*out, {"role": "user", "content": self.turns[len(answers)]}]

    def text(self, answers: Sequence[str] = ()) -> str:
        """The same conversation as plain text (paragraphs), for a model without a chat
        template: it continues the text."""
        return "\n\n".join(m["content"] for m in self.messages(answers))


@dataclass(frozen=True)
class PromptFile:
    path: str
    format: str  # one of FORMATS (the first record's, for JSON)
    records: list[PromptRecord]

    @property
    def categories(self) -> list[str]:
        """The categories in the order they first appear (empty when no record has one)."""
        return list(dict.fromkeys(r.category for r in self.records if r.category is not None))


def read_prompt_file(path: str | os.PathLike[str], option: str = "--prompts") -> PromptFile:
    """Every record of a prompt file; a one-line ``InputError`` (naming ``option``, the file
    and the line) for a file that cannot be read or a record of no known format."""
    p = Path(path)
    if not p.is_file():
        what = "a folder" if p.is_dir() else "not found"
        raise InputError(f"{option} {path}: {what}; pass a JSONL, JSON or text file of prompts.")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise InputError(
            f"{option} {path}: not UTF-8 text (byte {e.start}); pass a JSONL, JSON or text file."
        ) from None
    except OSError as e:
        raise InputError(f"{option} {path}: cannot be read ({e.strerror}).") from None
    if text.lstrip().startswith(("{", "[")):
        records, fmt = _read_json(text, f"{option} {path}")
    else:
        records = [PromptRecord((d,), chat=False) for d in split_documents(text)]
        fmt = "paragraphs"
    if not records:
        raise InputError(f"{option} {path}: no prompts in it.")
    return PromptFile(str(path), fmt, records)


def select(
    records: Sequence[PromptRecord],
    limit: int | None = None,
    split: str = "all",
    seed: int = 0,
) -> list[PromptRecord]:
    """The records of ``split`` (all, or the seeded tune / eval half of each category), at
    most ``limit`` per category, in file order."""
    if split not in SPLITS:
        raise InputError(f"split must be one of {', '.join(SPLITS)}, got {split!r}.")
    kept: list[PromptRecord] = []
    per: dict[str | None, int] = {}
    for record in records:
        if split != "all" and split_of(record, seed) != split:
            continue
        if limit is not None and per.get(record.category, 0) >= limit:
            continue
        per[record.category] = per.get(record.category, 0) + 1
        kept.append(record)
    return kept


def split_of(record: PromptRecord, seed: int = 0) -> str:
    """ "eval" for a seeded ``EVAL_FRACTION`` of records, else "tune": from the record's text,
    so neither the file's order nor the records beside it move it to the other side."""
    key = json.dumps([seed, record.category, record.context, record.turns]).encode()
    draw = int.from_bytes(hashlib.sha256(key).digest()[:8], "big") / 2**64
    return "eval" if draw < EVAL_FRACTION else "tune"


def _read_json(text: str, where: str) -> tuple[list[PromptRecord], str]:
    """Records of a JSON array / object, or of JSON lines (one object per line)."""
    try:
        whole = json.loads(text)
    except json.JSONDecodeError:
        whole = None
    if isinstance(whole, list):
        items: list[tuple[int, Any]] = [(i + 1, item) for i, item in enumerate(whole)]
        unit = "record"
    elif isinstance(whole, dict):  # one object: a one-line JSONL file, or a JSON file
        items, unit = [(1, whole)], "record" if "\n" in text.strip() else "line"
    else:
        items, unit = [], "line"
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                items.append((n, json.loads(line)))
            except json.JSONDecodeError as e:
                raise InputError(f"{where} line {n}: not JSON ({e.msg}).") from None
    records, formats = [], []
    for n, item in items:
        record, fmt = _record(item, f"{where} {unit} {n}")
        records.append(record)
        formats.append(fmt)
    return records, formats[0] if formats else "turns"


def _record(item: Any, where: str) -> tuple[PromptRecord, str]:
    if not isinstance(item, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(item).__name__}.")
    category = item.get("category")
    category = None if category is None else str(category)
    rid = next((str(item[k]) for k in ("question_id", "id") if item.get(k) is not None), None)
    if "turns" in item:
        turns = item["turns"]
        if not isinstance(turns, list) or not turns:
            raise InputError(f"{where}: `turns` must be a non-empty list of strings.")
        refs = item.get("reference")
        answer = refs[0] if isinstance(refs, list) and refs and isinstance(refs[0], str) else None
        texts = tuple(_text(t, where, "turns") for t in turns)
        return PromptRecord(texts, (), category, rid, answer or None), "turns"
    for key in ("messages", "conversations"):
        if key in item:
            context, turn, answer = _messages(item[key], where, key)
            return PromptRecord((turn,), context, category, rid, answer), "messages"
    if "instruction" in item:
        instruction = _text(item["instruction"], where, "instruction")
        given = item.get("input")
        if given is None and isinstance(item.get("instances"), list) and item["instances"]:
            first = item["instances"][0]
            given = first.get("input") if isinstance(first, dict) else None
        extra = "" if given is None else _text(given, where, "input", empty=True).strip()
        prompt = f"{instruction.strip()}\n\n{extra}" if extra else instruction.strip()
        return PromptRecord((prompt,), (), category, rid, _written_answer(item)), "instruction"
    for key in ("prompt", "text"):
        if key in item:
            text = _text(item[key], where, key)
            return PromptRecord((text,), (), category, rid, chat=key == "prompt"), "prompt"
    keys = ", ".join(sorted(item)) or "none"
    raise InputError(
        f"{where}: no prompt in it (keys: {keys}); a record needs `turns`, `messages`, "
        "`conversations`, `instruction`, `prompt` or `text`."
    )


def _messages(
    messages: Any, where: str, key: str = "messages"
) -> tuple[tuple[tuple[str, str], ...], str, str | None]:
    """(the messages before the last user message, that message's text, the assistant's
    answer after it or None). ``conversations`` is ShareGPT's spelling of the same."""
    if not isinstance(messages, list) or not messages:
        raise InputError(f"{where}: `{key}` must be a non-empty list of {{role, content}}.")
    sharegpt = key == "conversations"
    pairs: list[tuple[str, str]] = []
    for m in messages:
        if not isinstance(m, dict):
            role = None
        elif sharegpt:
            role = SHAREGPT_ROLES.get(str(m.get("from")))
        else:
            role = m.get("role")
        if role not in ROLES:
            raise InputError(
                f"{where}: each message needs a role of {', '.join(ROLES)}, got {role!r}."
            )
        pairs.append((role, _content(m.get("value" if sharegpt else "content"), where)))
    last = max((i for i, (role, _) in enumerate(pairs) if role == "user"), default=None)
    if last is None:
        raise InputError(f"{where}: `{key}` has no user message to answer.")
    after = pairs[last + 1] if last + 1 < len(pairs) else None
    answer = after[1] if after is not None and after[0] == "assistant" and after[1] else None
    return tuple(pairs[:last]), pairs[last][1], answer


def _written_answer(item: dict[str, Any]) -> str | None:
    """An instruction record's written answer: ``output`` / ``response``, or its first
    instance's ``output`` (self-instruct)."""
    answer = item.get("output") or item.get("response")
    instances = item.get("instances")
    if not answer and isinstance(instances, list) and instances and isinstance(instances[0], dict):
        answer = instances[0].get("output")
    return answer.strip() or None if isinstance(answer, str) else None


def _content(content: Any, where: str) -> str:
    """A message's text: a string, or OpenAI's list of parts (their text parts joined)."""
    if isinstance(content, list):
        parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        content = "".join(p for p in parts if isinstance(p, str))
    return _text(content, where, "content", empty=True)


def _text(value: Any, where: str, key: str, empty: bool = False) -> str:
    if not isinstance(value, str) or (not empty and not value.strip()):
        raise InputError(f"{where}: `{key}` must be a non-empty string, got {value!r:.40}.")
    return value
