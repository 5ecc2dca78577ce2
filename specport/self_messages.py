"""User messages a chat model writes itself: training requests for a draft head without a
dataset.

Given its chat template up to where a user's message begins (BOS, the default system message,
the user header), an instruction-tuned model continues with something a user would send.
Sampling that prefix at temperature 1 gives varied requests in the model's own domain (the
Magpie method, Xu et al. 2024); the draft head then learns the model's answers to requests
like its users', not one collection's sixteen phrasings. Only messages the model ends itself
(its end-of-turn token) within ``MAX_TOKENS`` are kept: a cut-off message is mostly a letter or
a story the model drifted into, not a request.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specport.core.errors import InputError
from specport.core.progress import Loop

if TYPE_CHECKING:
    from specport.core.chat_template import ChatTemplate

logger = logging.getLogger(__name__)

MAX_TOKENS = 64  # a finished request is 10-45 tokens on SmolLM2; longer ones are mostly drift
MIN_TOKENS = 4
BATCH = 32
TEMPERATURE = 1.0
TOP_P = 0.95
FILE = "self_messages.json"  # in the training folder: what was sampled, reused by a rerun


def user_prefix(template: ChatTemplate | None) -> list[int]:
    """The ids the model continues to write a request: its chat template up to where a user's
    text begins. A clear error for an artifact without a template, or with one that does not
    write the user's text (``train-draft`` checks this before its long work)."""
    if template is None:
        raise InputError(
            "--messages self and mixed need the artifact's chat template (the model writes "
            "requests after its user header); this artifact has none: pass --data FILE instead."
        )
    return template.user_prefix_ids()


def self_messages(model: Any, template: Any, count: int, work: Path, seed: int = 0) -> list[str]:
    """``count`` distinct user messages sampled from ``model`` after ``template``'s user
    header, kept in ``work``/``FILE``: a rerun samples only the batches it lacks (batch ``i``
    uses seed ``seed + i``, so the messages do not depend on how the work was split)."""
    prefix = user_prefix(template)
    path = work / FILE
    saved = _read(path, prefix, seed)
    messages: list[str] = saved["messages"]
    batches: int = saved["batches"]
    seconds: float = saved["seconds"]
    if len(messages) >= count:
        return messages[:count]
    logger.info("sampling user messages: %d of %d kept so far", len(messages), count)
    seen = set(messages)
    with Loop(count, "writing user messages") as loop:
        loop.update(len(messages))
        while len(messages) < count:
            if batches > 8 + 4 * count // BATCH:
                raise InputError(
                    f"the model ended only {len(messages)} user messages of {batches * BATCH} "
                    f"sampled within {MAX_TOKENS} tokens; it does not write requests after its "
                    "user header. Pass --data FILE (one message per paragraph) instead."
                )
            t0 = time.perf_counter()
            results = model.generate_batch(
                prompt_ids=[prefix] * BATCH,
                max_new_tokens=MAX_TOKENS,
                temperature=TEMPERATURE,
                top_p=TOP_P,
                seed=seed + batches,
            )
            batches += 1
            kept = 0
            for r in results:
                text = r.text.strip()
                if r.finish_reason == "length" or len(r.tokens) < MIN_TOKENS or not text:
                    continue
                if text not in seen:
                    seen.add(text)
                    messages.append(text)
                    kept += 1
            seconds += time.perf_counter() - t0
            loop.update(kept)
            _write(path, prefix, seed, messages, batches, seconds)
    logger.info(
        "sampled %d user messages in %d batches of %d (%.0f s)",
        len(messages),
        batches,
        BATCH,
        seconds,
    )
    return messages[:count]


def sampling_seconds(work: Path) -> float | None:
    """Seconds the saved messages took to sample (None when none were)."""
    path = work / FILE
    if not path.is_file():
        return None
    return float(json.loads(path.read_text()).get("seconds") or 0.0)


def _read(path: Path, prefix: list[int], seed: int) -> dict[str, Any]:
    empty: dict[str, Any] = {"messages": [], "batches": 0, "seconds": 0.0}
    if not path.is_file():
        return empty
    saved = json.loads(path.read_text())
    if saved.get("prefix") != prefix or saved.get("seed") != seed:
        return empty  # another template or seed: sample afresh
    return saved


def _write(
    path: Path, prefix: list[int], seed: int, messages: list[str], batches: int, seconds: float
) -> None:
    record = {
        "prefix": prefix,
        "seed": seed,
        "sampling": {"temperature": TEMPERATURE, "top_p": TOP_P, "max_tokens": MAX_TOKENS},
        "batches": batches,
        "seconds": round(seconds, 3),
        "messages": messages,
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)
