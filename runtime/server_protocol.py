"""The OpenAI wire format of `specport serve`: parse request bodies, shape response bodies.

Kept apart from the socket handling (runtime/server.py) so every rule about what a client may
send, and what it gets back, is a plain function of JSON in and JSON out. Bad input raises
`APIError` carrying the HTTP status and an OpenAI-style error body, so the handler never has to
guess a status and a client never sees a Python traceback.

Semantics follow OpenAI's: temperature 0 means greedy, defaults are temperature 1 / top_p 1
(sampling), `max_tokens` defaults to 16 for completions and to the rest of the context for chat.
Fields that would silently change the meaning of a request if ignored (n > 1, echo, logprobs,
penalties, tools...) are refused with a 400 that says so; other unknown fields are ignored.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from specport.errors import InputError, SpecportError
from specport.runtime.chat_template import ChatTemplate
from specport.runtime.engine.base import Request
from specport.runtime.sampler import SamplingConfig

logger = logging.getLogger(__name__)

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class APIError(Exception):
    """A request the server answers with an OpenAI error body instead of a result."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@dataclass
class ServedModel:
    """What the protocol layer needs to know about the model behind the server."""

    name: str
    model: Any  # specport.api.Model: encode, tokenizer, manifest, path
    created: int = field(default_factory=lambda: int(time.time()))
    engine_max_length: int | None = None  # KV positions per request the engine reserves

    @property
    def context_length(self) -> int:
        m = self.model.manifest
        limit = m.kv.max_length if m.kv.layout == "shared" else None
        length = min(m.context_length, limit or m.context_length)
        return int(min(length, self.engine_max_length or length))

    @property
    def vocab_size(self) -> int:
        return int(self.model.manifest.vocab_size)


@dataclass
class ParsedRequest:
    """A validated request: the engine's `Request` plus how the client wants the answer."""

    kind: str  # "completion" | "chat"
    request: Request
    stream: bool
    include_usage: bool = False  # stream_options.include_usage
    return_token_ids: bool = False


# ---------------------------------------------------------------------------- parsing


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def parse_json_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


_REFUSED = {
    # field: (value that is fine, why it is refused otherwise)
    "echo": (False, "echo is not supported; the response holds only the generated text"),
    "logprobs": (None, "logprobs are not supported by specport serve"),
    "top_logprobs": (None, "top_logprobs are not supported by specport serve"),
    "suffix": (None, "suffix (insertion) is not supported by specport serve"),
    "best_of": (1, "best_of other than 1 is not supported; send one request per completion"),
    "presence_penalty": (0, "presence_penalty is not supported; use repetition_penalty"),
    "frequency_penalty": (0, "frequency_penalty is not supported; use repetition_penalty"),
    "logit_bias": (None, "logit_bias is not supported by specport serve"),
    "tools": (None, "tools / function calling are not supported by specport serve"),
    "functions": (None, "function calling is not supported by specport serve"),
}


def _refuse_unsupported(body: dict[str, Any]) -> None:
    for name, (fine, why) in _REFUSED.items():
        value = body.get(name)
        if value is None or value == fine or value in ({}, [], False):
            continue
        raise APIError(400, why, param=name, code="unsupported")
    n = body.get("n")
    if n is not None and n != 1:
        raise APIError(
            400,
            f"n={n!r} is not supported: specport serve returns one choice per request; "
            "send n separate requests (they are served concurrently)",
            param="n",
            code="unsupported",
        )
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type", "text") == "text"):
        raise APIError(
            400, "response_format other than text is not supported", param="response_format"
        )


def _number(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise APIError(400, f"{name} must be a number, got {value!r}", param=name)
    return float(value)


def _integer(body: dict[str, Any], name: str, default: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise APIError(400, f"{name} must be an integer, got {value!r}", param=name)
    return value


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise APIError(400, f"{name} must be true or false, got {value!r}", param=name)
    return value


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise APIError(
            400, f"stop must be a non-empty string or a list of them, got {stop!r}", param="stop"
        )
    return tuple(stops)


def _sampling(body: dict[str, Any]) -> SamplingConfig:
    temperature = _number(body, "temperature", 1.0)
    if temperature < 0:
        raise APIError(
            400, f"temperature must be >= 0 (0 = greedy), got {temperature}", param="temperature"
        )
    config = SamplingConfig(
        greedy=temperature == 0.0,
        temperature=temperature if temperature > 0 else 1.0,
        top_k=_integer(body, "top_k", 0) or 0,
        top_p=_number(body, "top_p", 1.0),
        min_p=_number(body, "min_p", 0.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0),
        seed=_integer(body, "seed", None),
    )
    if config.top_k == -1:  # vLLM's spelling of "off"
        config = SamplingConfig(**{**config.__dict__, "top_k": 0})
    try:
        return config.validate()
    except SpecportError as e:
        raise APIError(400, str(e)) from None


def _check_ids(ids: list[Any], served: ServedModel, param: str) -> list[int]:
    if not ids:
        raise APIError(400, f"{param} is empty; send some text or token ids", param=param)
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise APIError(400, f"{param} must be a string or a list of integer token ids", param=param)
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


def _prompt_ids(body: dict[str, Any], served: ServedModel) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return _encode(served, prompt, "prompt")
    if isinstance(prompt, list):
        if prompt and all(isinstance(p, (str, list)) for p in prompt):
            raise APIError(
                400,
                "a list of prompts is not supported: send one prompt per request "
                "(requests are served concurrently)",
                param="prompt",
            )
        return _check_ids(prompt, served, "prompt")
    if prompt is None:
        raise APIError(400, "prompt is required (a string or a list of token ids)", param="prompt")
    raise APIError(
        400, f"prompt must be a string or a list of token ids, got {prompt!r}", param="prompt"
    )


def _check_model(body: dict[str, Any], served: ServedModel) -> None:
    name = body.get("model")
    if name is not None and name != served.name:
        raise APIError(
            404,
            f"the model {name!r} does not exist; this server serves {served.name!r}",
            param="model",
            code="model_not_found",
        )


def _finish(
    kind: str, body: dict[str, Any], served: ServedModel, ids: list[int], default_max: int | None
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
    max_tokens = _integer(body, name, None)
    if max_tokens is None and kind == "chat":
        name = "max_completion_tokens"
        max_tokens = _integer(body, name, None)
    if max_tokens is None:
        max_tokens = default_max if default_max is not None else context - len(ids)
    if max_tokens < 1:
        raise APIError(400, f"{name} must be at least 1, got {max_tokens}", param=name)
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise APIError(400, "stream_options must be an object", param="stream_options")
    request = Request(
        prompt_ids=ids,
        max_new_tokens=max_tokens,
        sampling=_sampling(body),
        stop=_stop(body),
        ignore_eos=_flag(body, "ignore_eos"),
        request_id=new_id("chatcmpl" if kind == "chat" else "cmpl"),
    )
    return ParsedRequest(
        kind,
        request,
        stream,
        include_usage=bool(stream and options and options.get("include_usage")),
        return_token_ids=_flag(body, "return_token_ids") or served.model.tokenizer is None,
    )


def parse_completion(body: dict[str, Any], served: ServedModel) -> ParsedRequest:
    """POST /v1/completions body -> engine request (raises APIError on bad input)."""
    _check_model(body, served)
    _refuse_unsupported(body)
    ids = _prompt_ids(body, served)
    return _finish("completion", body, served, ids, COMPLETION_DEFAULT_MAX_TOKENS)


def parse_chat(
    body: dict[str, Any], served: ServedModel, template: ChatTemplate | None
) -> ParsedRequest:
    """POST /v1/chat/completions body -> engine request, the prompt from the chat template."""
    _check_model(body, served)
    _refuse_unsupported(body)
    messages = _messages(body)
    if template is None:
        raise APIError(
            400,
            "this model has no chat template (none in the artifact's tokenizer files), so "
            "/v1/chat/completions cannot build a prompt; use /v1/completions with a plain prompt",
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
    return _finish("chat", body, served, ids, None)


def _messages(body: dict[str, Any]) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(
            400, "messages must be a non-empty list of {role, content} objects", param="messages"
        )
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(
                400, f"messages[{i}] must be an object with a string role", param="messages"
            )
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            parts = []
            for part in content:
                if not (
                    isinstance(part, dict)
                    and part.get("type") == "text"
                    and isinstance(part.get("text"), str)
                ):
                    raise APIError(
                        400,
                        f"messages[{i}].content: only text parts are supported",
                        param="messages",
                    )
                parts.append(part["text"])
            content = "".join(parts)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be a string", param="messages")
        out.append({"role": m["role"], "content": content})
    return out
