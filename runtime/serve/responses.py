"""OpenAI response bodies of `specport serve`: whole answers, stream chunks, logprobs, model cards.

Plain functions of the parsed request and the engine's output, so the wire format is defined in
one place and the app (app.py) only moves bytes. Shapes are OpenAI's (the official client parses
them in the tests); `token_ids` / `prompt_token_ids` are vLLM's `return_token_ids` extension.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from specport.runtime.engine.base import TokenLogprobs
from specport.runtime.serve.protocol import ParsedRequest
from specport.runtime.serve.served import ServedModel

# engine finish reasons -> OpenAI's ("eos" is what the plain generator calls an EOS stop)
FINISH_REASONS = {"stop": "stop", "eos": "stop", "length": "length", "context": "length"}


def finish_reason(engine_reason: str | None) -> str:
    return FINISH_REASONS.get(engine_reason or "", "stop")


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


@dataclass
class Choice:
    """What one choice has produced so far (a whole answer collects all its events here)."""

    text: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish: str | None = None


class TokenText:
    """Token id -> its text for logprobs (decoded alone; "token_id:N" without a tokenizer)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.text = lru_cache(maxsize=65536)(self._text)

    def _text(self, token: int) -> str:
        if self.model.tokenizer is None:
            return f"token_id:{token}"
        return str(self.model.tokenizer.decode([token], skip_special_tokens=False))


def _envelope(
    parsed: ParsedRequest, served: ServedModel, created: int, chunk: bool
) -> dict[str, Any]:
    if parsed.kind == "chat":
        obj = "chat.completion.chunk" if chunk else "chat.completion"
    else:
        obj = "text_completion"
    return {"id": parsed.request_id, "object": obj, "created": created, "model": served.name}


def logprobs_body(
    parsed: ParsedRequest, names: TokenText, items: Sequence[TokenLogprobs], offset: int = 0
) -> dict[str, Any] | None:
    """OpenAI's logprobs object: chat's `content` list, or completions' parallel lists."""
    if parsed.logprobs is None:
        return None
    if parsed.kind == "chat":

        def entry(token: int, logprob: float) -> dict[str, Any]:
            text = names.text(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        content = []
        for item in items:
            row = entry(item.token, item.logprob)
            row["top_logprobs"] = [entry(t, lp) for t, lp in item.top]
            content.append(row)
        return {"content": content}
    tokens = [names.text(item.token) for item in items]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [item.logprob for item in items],
        "top_logprobs": [{names.text(t): lp for t, lp in item.top} for item in items],
        "text_offset": offsets,
    }


def full_response(
    parsed: ParsedRequest,
    served: ServedModel,
    names: TokenText,
    choices: Sequence[Choice],
    created: int,
    echo_text: str = "",
) -> dict[str, Any]:
    """The non-streamed answer: every choice with all its text, and the token usage."""
    out = []
    for i, c in enumerate(choices):
        text = "".join(c.text)
        choice: dict[str, Any] = {"index": i}
        if parsed.kind == "chat":
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = echo_text + text
        choice["logprobs"] = logprobs_body(parsed, names, c.logprobs, len(echo_text))
        choice["finish_reason"] = finish_reason(c.finish)
        if parsed.return_token_ids:
            choice["token_ids"] = list(c.tokens)
        out.append(choice)
    body = _envelope(parsed, served, created, chunk=False)
    body["choices"] = out
    body["usage"] = usage(len(parsed.prompt_ids), sum(len(c.tokens) for c in choices))
    if parsed.return_token_ids:
        body["prompt_token_ids"] = parsed.prompt_ids
    return body


def stream_chunk(
    parsed: ParsedRequest,
    served: ServedModel,
    created: int,
    index: int = 0,
    text: str | None = None,
    token_ids: list[int] | None = None,
    engine_reason: str | None = None,
    role: bool = False,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One SSE chunk: new text (chat: as `delta`), or the final one with `finish_reason`."""
    choice: dict[str, Any] = {"index": index}
    if parsed.kind == "chat":
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    choice["logprobs"] = logprobs
    choice["finish_reason"] = finish_reason(engine_reason) if engine_reason else None
    if parsed.return_token_ids and token_ids is not None:
        choice["token_ids"] = list(token_ids)
    body = _envelope(parsed, served, created, chunk=True)
    body["choices"] = [choice]
    return body


def usage_chunk(
    parsed: ParsedRequest, served: ServedModel, created: int, completion_tokens: int
) -> dict[str, Any]:
    """stream_options.include_usage: the last chunk before [DONE], no choices, only usage."""
    body = _envelope(parsed, served, created, chunk=True)
    body["choices"] = []
    body["usage"] = usage(len(parsed.prompt_ids), completion_tokens)
    return body


def models_list(served: ServedModel) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(served)]}


def model_card(served: ServedModel) -> dict[str, Any]:
    return {
        "id": served.name,
        "object": "model",
        "created": served.created,
        "owned_by": "specport",
        "max_model_len": served.context_length,
    }
