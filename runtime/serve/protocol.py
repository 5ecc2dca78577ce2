"""OpenAI request bodies -> engine requests: every rule about what a client may send.

A plain function of JSON in and `ParsedRequest` (or `APIError`) out, kept apart from the ASGI
app so the wire rules are testable and the app only moves bytes. Bad input raises `APIError`
with the HTTP status and an OpenAI error body, so a client never sees a Python traceback.

Semantics follow OpenAI's: temperature 0 means greedy, defaults are temperature 1 / top_p 1
(sampling), `max_tokens` defaults to 16 for completions and to the rest of the context for chat,
and a `max_tokens` that cannot fit beside the prompt is refused (400, with the limit) rather
than silently capped. Fields whose loss would change the answer (tools, suffix, best_of) are
refused by name; other unknown fields are ignored.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from dataclasses import dataclass, replace
from typing import Any

from pydantic import ValidationError

from specport.core.chat_template import ChatTemplate
from specport.core.errors import InputError
from specport.runtime.engine.base import Request
from specport.runtime.serve.api_error import APIError
from specport.runtime.serve.fields import (
    grammar,
    logprobs_k,
    refuse_unsupported,
    sampling_config,
    stop_strings,
)
from specport.runtime.serve.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    _Sampling,
    describe,
)
from specport.runtime.serve.served import ServedModel

logger = logging.getLogger(__name__)

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_N = 16  # choices per request (each holds a KV row)
MAX_JSON_DEPTH = 64  # nesting of a request body (a JSON schema for structured output included)


@dataclass
class ParsedRequest:
    """A validated request: `n` engine requests (one per choice) plus how to answer."""

    kind: str  # "completion" | "chat"
    request_id: str
    requests: list[Request]  # one per choice, all on the same prompt
    stream: bool
    include_usage: bool = False  # stream_options.include_usage
    return_token_ids: bool = False
    logprobs: int | None = None  # None: no logprobs; k: the chosen token's and the top k's
    echo: bool = False  # completions: the prompt's text starts each choice
    constraint: Any = None  # a structured-output grammar (runtime/serve/structured.py)

    @property
    def request(self) -> Request:
        return self.requests[0]

    @property
    def prompt_ids(self) -> list[int]:
        return list(self.requests[0].prompt_ids)


# ---------------------------------------------------------------------------- parsing


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object: strict JSON (no NaN / Infinity), nested at most
    `MAX_JSON_DEPTH` levels (deeper bodies are refused before they reach the parser's
    recursion limit)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not valid UTF-8: {e}") from None
    if _deeper_than(text, MAX_JSON_DEPTH):
        raise APIError(
            400,
            f"the request body is nested more than {MAX_JSON_DEPTH} levels deep; this server "
            f"accepts at most {MAX_JSON_DEPTH}",
        )
    try:
        body = json.loads(text, parse_constant=_no_constant)
    except (json.JSONDecodeError, ValueError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


def _deeper_than(text: str, limit: int) -> bool:
    """Whether [ and { nest deeper than `limit` in JSON text (brackets in strings not counted)."""
    depth = 0
    for match in _BRACKETS.finditer(text):
        token = match.group()
        if token in "[{":
            depth += 1
            if depth > limit:
                return True
        elif token in "]}":
            depth -= 1
    return False


_BRACKETS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def _validate(model: type[_Sampling], body: dict[str, Any]) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        message, param = describe(e)
        raise APIError(400, message, param=param) from None


def _check_ids(ids: list[int], served: ServedModel, param: str) -> list[int]:
    if not ids:
        raise APIError(400, f"{param} is empty; send some text or token ids", param=param)
    bad = [t for t in ids if not 0 <= t < served.vocab_size]
    if bad:
        raise APIError(
            400,
            f"token ids {bad[:5]} are outside the vocabulary (0..{served.vocab_size - 1})",
            param=param,
        )
    return ids


def _encode(served: ServedModel, text: str, param: str) -> list[int]:
    if served.model.tokenizer is None:
        raise APIError(
            400,
            "this model has no tokenizer; send the prompt as a list of token ids "
            '(/v1/completions with "prompt": [1, 2, 3])',
            param=param,
        )
    if not text:
        raise APIError(400, f"{param} is empty; send some text or token ids", param=param)
    return list(served.model.encode(text))


def _prompt_ids(req: CompletionRequest, served: ServedModel) -> list[int]:
    prompt: Any = req.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return _encode(served, prompt, "prompt")
    if prompt is None:
        raise APIError(400, "prompt is required (a string or a list of token ids)", param="prompt")
    if prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise APIError(
            400,
            "a list of prompts is not supported: send one prompt per request "
            "(requests are served concurrently), or use n for several answers to one prompt",
            param="prompt",
        )
    return _check_ids(list(prompt), served, "prompt")


def _check_model(req: _Sampling, served: ServedModel) -> None:
    if req.model is not None and req.model != served.name:
        raise APIError(
            404,
            f"the model {req.model!r} does not exist; this server serves {served.name!r}",
            param="model",
            code="model_not_found",
        )


def _finish(
    kind: str,
    req: Any,
    served: ServedModel,
    ids: list[int],
    default_max: int | None,
) -> ParsedRequest:
    context = served.context_length
    if len(ids) >= context:
        raise APIError(
            400,
            f"the prompt has {len(ids)} tokens but the model's context window is {context} "
            f"tokens (and at least one new token must fit); shorten it to at most "
            f"{context - 1} tokens",
            param="messages" if kind == "chat" else "prompt",
            code="context_length_exceeded",
        )
    name = "max_tokens"
    max_tokens = req.max_tokens
    if max_tokens is None and kind == "chat":
        name = "max_completion_tokens"
        max_tokens = req.max_completion_tokens
    room = context - len(ids)
    cap = served.max_tokens
    if max_tokens is None:
        default = min(x for x in (default_max, cap, room) if x is not None)
        max_tokens = default
    if max_tokens < 1:
        raise APIError(400, f"{name} must be at least 1, got {max_tokens}", param=name)
    if cap is not None and max_tokens > cap:
        raise APIError(
            400,
            f"{name}={max_tokens} is over this server's limit of {cap} new tokens per "
            f"request (--max-tokens); ask for at most {cap}",
            param=name,
        )
    if max_tokens > room:
        raise APIError(
            400,
            f"{name}={max_tokens} does not fit: the prompt has {len(ids)} tokens and the "
            f"context window is {context}, so at most {room} new tokens fit; lower {name} "
            "or shorten the prompt",
            param=name,
            code="context_length_exceeded",
        )
    n = 1 if req.n is None else req.n
    if not 1 <= n <= MAX_N:
        raise APIError(400, f"n must be in 1..{MAX_N}, got {n}", param="n")
    stream = bool(req.stream)
    options = req.stream_options
    request_id = new_id("chatcmpl" if kind == "chat" else "cmpl")
    config = sampling_config(req, served.vocab_size)
    if n > 1 and config.greedy:
        logger.debug("n=%d with greedy decoding: the choices will be equal", n)
    logprobs = logprobs_k(kind, req, served)
    compiled = grammar(req, served, config.greedy)
    if compiled is not None:
        config = replace(config, constraint=served.grammars().constraint(compiled))
    base = Request(
        prompt_ids=ids,
        max_new_tokens=max_tokens,
        sampling=config,
        stop=stop_strings(req),
        ignore_eos=bool(req.ignore_eos),
        request_id=request_id,
        logprobs=logprobs,
    )
    requests = [base]
    for i in range(1, n):  # each choice its own stream of random numbers
        seed = None if config.seed is None else config.seed + i
        choice = replace(config, seed=seed)
        if compiled is not None:  # a grammar's state is per sequence
            choice = replace(choice, constraint=served.grammars().constraint(compiled))
        requests.append(replace(base, sampling=choice, request_id=f"{request_id}-{i}"))
    return ParsedRequest(
        kind,
        request_id,
        requests,
        stream,
        include_usage=bool(stream and options and options.include_usage),
        return_token_ids=bool(req.return_token_ids) or served.model.tokenizer is None,
        logprobs=logprobs,
        echo=bool(getattr(req, "echo", False)),
    )


def parse_completion(body: dict[str, Any], served: ServedModel) -> ParsedRequest:
    """POST /v1/completions body -> engine requests (raises APIError on bad input)."""
    req = _validate(CompletionRequest, body)
    _check_model(req, served)
    refuse_unsupported(req)
    ids = _prompt_ids(req, served)
    return _finish("completion", req, served, ids, COMPLETION_DEFAULT_MAX_TOKENS)


def parse_chat(
    body: dict[str, Any], served: ServedModel, template: ChatTemplate | None
) -> ParsedRequest:
    """POST /v1/chat/completions body -> engine requests, the prompt from the chat template."""
    req = _validate(ChatCompletionRequest, body)
    _check_model(req, served)
    refuse_unsupported(req)
    messages = _messages(req)
    if template is None:
        raise APIError(
            400,
            "this model has no chat template (none in the artifact's tokenizer files), so "
            "/v1/chat/completions cannot build a prompt; start the server with "
            "--chat-template FILE, or use /v1/completions with a plain prompt",
            param="messages",
            code="no_chat_template",
        )
    try:
        ids = template.render_ids(messages)
    except InputError as e:
        raise APIError(400, str(e), param="messages") from None
    except Exception as e:  # noqa: BLE001 - a template error is the request's problem to report
        raise APIError(
            400, f"the chat template could not render these messages: {e}", param="messages"
        ) from None
    return _finish("chat", req, served, ids, None)


def _messages(req: ChatCompletionRequest) -> list[dict[str, str]]:
    if not req.messages:
        raise APIError(
            400, "messages must be a non-empty list of {role, content} objects", param="messages"
        )
    out = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            parts = []
            for part in content:
                if not (part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise APIError(
                        400,
                        f"messages[{i}].content: only text parts are supported",
                        param="messages",
                    )
                parts.append(part["text"])
            content = "".join(parts)
        out.append({"role": m.role, "content": content or ""})
    return out
