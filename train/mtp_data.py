"""Training data for MTP heads: the frozen base model's own greedy text.

Greedy speculative decoding accepts a draft only when it equals the base model's argmax, so
the heads are trained on what the base model itself writes. Two sources of prompts:
- plain text (`--data`): the first tokens of each document, continued greedily;
- chat (`--data` with `--chat`): each document is a user message rendered with the artifact's
  chat template, so the heads learn the model's answers exactly as `chat`/`serve` prompt it
  (a chat model's answers are not what it writes after a bare sentence opening).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from specport.core.chat_template import load_chat_template
from specport.core.errors import InputError
from specport.core.progress import Loop
from specport.core.tokenizer import encode_prompt

logger = logging.getLogger(__name__)


def read_prompts(data: Path, tokenizer: Any, prompt_len: int, limit: int) -> torch.Tensor:
    """[N, prompt_len] openings of the blank-line-separated documents in ``data``."""
    if not Path(data).is_file():
        raise InputError(
            f"--data {data} is not a file; pass a text file with one document per paragraph."
        )
    rows = []
    for doc in Path(data).read_text(encoding="utf-8").split("\n\n"):
        doc = doc.strip()
        if doc:
            ids = encode_prompt(tokenizer, doc)
            if len(ids) >= prompt_len:
                rows.append(ids[:prompt_len])
        if len(rows) >= limit:
            break
    if len(rows) < 8:
        raise InputError(
            f"--data {data} has only {len(rows)} documents of >= {prompt_len} tokens; need at least 8."
        )
    return torch.tensor(rows, dtype=torch.long)


@torch.no_grad()
def self_generate(
    base: Any, prompts: torch.Tensor, new_tokens: int, batch: int = 64
) -> torch.Tensor:
    """Greedy continuations [N, P + new_tokens] of the prompts by the base model (EOS ignored)."""
    out = []
    batches = range(0, len(prompts), batch)
    with (
        _eos_ignored(base),
        Loop(len(batches) * new_tokens, "self-generating training text") as loop,
    ):
        for i in batches:
            ids = prompts[i : i + batch]
            out.append(
                base.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    do_sample=False,
                    max_new_tokens=new_tokens,
                    pad_token_id=0,
                    stopping_criteria=_ticks(loop),
                )
            )
    return torch.cat(out)


def _ticks(loop: Loop) -> Any:
    """A stopping criterion that never stops and moves `loop` one step per generated token:
    a batch of answers takes minutes on a small CPU, and a line per batch read as a hang."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Tick(StoppingCriteria):  # type: ignore[misc]
        def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
            loop.update()
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    return StoppingCriteriaList([Tick()])


@contextmanager
def _eos_ignored(base: Any) -> Iterator[None]:
    """Generation runs the full length: `eos_token_id=None` passed to generate() means "the
    model's own", so the config's value is cleared for the duration instead."""
    saved = base.generation_config.eos_token_id
    base.generation_config.eos_token_id = None
    try:
        yield
    finally:
        base.generation_config.eos_token_id = saved


@torch.no_grad()
def base_hidden(base: Any, seqs: torch.Tensor, batch: int = 64) -> torch.Tensor:
    """[N, T, H] LM-head inputs (final hidden state after the final norm)."""
    return torch.cat(
        [
            base.model(input_ids=seqs[i : i + batch]).last_hidden_state
            for i in range(0, len(seqs), batch)
        ]
    )


def chat_prompts(data: Path, artifact: Path, tokenizer: Any, limit: int) -> list[list[int]]:
    """Token ids of each document of ``data`` as one user turn in the artifact's chat template."""
    if not Path(data).is_file():
        raise InputError(
            f"--data {data} is not a file; pass a text file with one message per paragraph."
        )
    template = load_chat_template(SimpleNamespace(tokenizer=tokenizer, path=artifact))
    if template is None:
        raise InputError(
            f"{artifact} has no chat template; --chat needs a chat model (drop --chat to train "
            "on plain text)."
        )
    rows = []
    for doc in Path(data).read_text(encoding="utf-8").split("\n\n"):
        if doc.strip():
            rows.append(template.render_ids([{"role": "user", "content": doc.strip()}]))
        if len(rows) >= limit:
            break
    if len(rows) < 8:
        if limit < 8:
            raise InputError(f"a limit of {limit} messages is too few; use at least 8.")
        raise InputError(f"{data} has only {len(rows)} messages; at least 8 are needed.")
    return rows


def self_generate_chat(
    model: Any,
    base: Any,
    prompts: list[list[int]],
    new_tokens: int,
    batch: int = 32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The artifact's own greedy answers to chat prompts of different lengths.

    The answers are decoded by onnxruntime on the artifact (batched, each answer ending at
    its EOS), which is what inference will decode and ~10x faster than transformers' generate
    on a small CPU; the LM-head inputs are then computed by the torch base model in one pass
    over each prompt + answer. Returns ``(seqs [N, 1 + new_tokens], hidden [N, 1 + new_tokens,
    H], valid [N, 1 + new_tokens])``: the last prompt token and the answer (padded after its
    end, where ``valid`` is False), with hidden states in the full prompt's context.

    ``model`` is the artifact loaded for generation (a `specport.Model`): loading one is the
    API's job, so train-mtp's caller hands it in (`specport.build.train_mtp`)."""
    seqs, hidden, valid = [], [], []
    for chunk, answers in greedy_answers(model, prompts, new_tokens, batch):
        s, h, v = answer_hidden(base, chunk, answers, new_tokens)
        seqs.append(s)
        hidden.append(h)
        valid.append(v)
    return torch.cat(seqs), torch.cat(hidden), torch.cat(valid)


def greedy_answers(
    model: Any,
    prompts: list[list[int]],
    new_tokens: int,
    batch: int = 32,
    desc: str = "self-generating chat answers",
) -> Iterator[tuple[list[list[int]], list[list[int]]]]:
    """(prompts, greedy answers) per batch, decoded by onnxruntime on a loaded artifact.

    Progress is by streamed piece of text (about a token): a batch of answers takes a minute
    on a real model, and a line per batch read as a hang."""
    with Loop(len(prompts) * new_tokens, desc) as loop:
        for i in range(0, len(prompts), batch):
            chunk = prompts[i : i + batch]
            start = loop.done
            results = model.generate_batch(
                prompt_ids=chunk,
                max_new_tokens=new_tokens,
                greedy=True,
                on_text=lambda _row, _text: loop.update(),
            )
            loop.update(max(0, start + len(chunk) * new_tokens - loop.done))
            yield chunk, [list(r.tokens) for r in results]


@torch.no_grad()
def answer_hidden(
    base: Any, prompts: list[list[int]], answers: list[list[int]], new_tokens: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(last prompt token + answer, LM-head inputs there, real-token mask), each [b, 1 + new_tokens]:
    prompts left-padded and masked, positions counted from each prompt's first real token."""
    width = max(len(p) for p in prompts)
    total = width + new_tokens
    ids = torch.zeros((len(prompts), total), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, (p, a) in enumerate(zip(prompts, answers)):
        a = list(a)[:new_tokens]
        ids[r, width - len(p) : width] = torch.tensor(p)
        ids[r, width : width + len(a)] = torch.tensor(a, dtype=torch.long)
        mask[r, width - len(p) : width + len(a)] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    h = base.model(input_ids=ids, attention_mask=mask, position_ids=positions).last_hidden_state
    return ids[:, width - 1 :], h[:, width - 1 :], mask[:, width - 1 :].bool()
