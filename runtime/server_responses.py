"""OpenAI response bodies of `specport serve`: whole answers, stream chunks, model cards.

Plain functions of the parsed request and the engine's output, so the wire format is defined in
one place and the socket code (runtime/server.py) only moves bytes.
"""

from __future__ import annotations

from typing import Any

from specport.runtime.server_protocol import ParsedRequest, ServedModel

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


def _envelope(
    parsed: ParsedRequest, served: ServedModel, created: int, chunk: bool
) -> dict[str, Any]:
    if parsed.kind == "chat":
        obj = "chat.completion.chunk" if chunk else "chat.completion"
    else:
        obj = "text_completion"
    return {
        "id": parsed.request.request_id,
        "object": obj,
        "created": created,
        "model": served.name,
    }


def full_response(
    parsed: ParsedRequest,
    served: ServedModel,
    text: str,
    token_ids: list[int],
    engine_reason: str | None,
    created: int,
) -> dict[str, Any]:
    """The non-streamed answer: one choice with all the text, and the token usage."""
    choice: dict[str, Any] = {"index": 0}
    if parsed.kind == "chat":
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    choice["logprobs"] = None
    choice["finish_reason"] = finish_reason(engine_reason)
    if parsed.return_token_ids:
        choice["token_ids"] = list(token_ids)
    body = _envelope(parsed, served, created, chunk=False)
    body["choices"] = [choice]
    body["usage"] = usage(len(parsed.request.prompt_ids), len(token_ids))
    if parsed.return_token_ids:
        body["prompt_token_ids"] = list(parsed.request.prompt_ids)
    return body


def stream_chunk(
    parsed: ParsedRequest,
    served: ServedModel,
    created: int,
    text: str | None = None,
    token_ids: list[int] | None = None,
    engine_reason: str | None = None,
    role: bool = False,
) -> dict[str, Any]:
    """One SSE chunk: new text (chat: as `delta`), or the final one with `finish_reason`."""
    choice: dict[str, Any] = {"index": 0}
    if parsed.kind == "chat":
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    choice["logprobs"] = None
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
    body["usage"] = usage(len(parsed.request.prompt_ids), completion_tokens)
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
