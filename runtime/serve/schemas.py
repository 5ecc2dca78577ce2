"""The OpenAI request bodies `specport serve` accepts, as pydantic models (the wire contract).

Strict types, as OpenAI's API checks them: `"max_tokens": "5"` is refused rather than coerced,
and `true` is not an integer. Unknown fields are ignored (clients send provider-specific extras),
except the ones whose silent loss would change what the client gets back (`tools`, `suffix`...),
which `protocol.py` refuses by name. vLLM's extra fields (`top_k`, `min_p`, `ignore_eos`,
`repetition_penalty`, `guided_*`, `return_token_ids`) are accepted because clients written for
vLLM send them through `extra_body`.

Responses are plain dicts built in `responses.py`: they follow OpenAI's shapes exactly, and
the official `openai` client is what the tests parse them with.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

# What a field must be, in words, for the 400 message (pydantic's own words name Python types).
FIELD_WORDS = {
    "prompt": "a string or a list of token ids",
    "stop": "a non-empty string or a list of them",
    "messages": "a non-empty list of {role, content} objects",
    "logit_bias": "an object mapping token ids to numbers in [-100, 100]",
    "response_format": 'an object like {"type": "json_schema", "json_schema": {...}}',
    "stream_options": "an object",
    "logprobs": "an integer (completions) or true/false (chat)",
}


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(_Body):
    name: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema", "regex", "grammar"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Body):
    """vLLM's `structured_outputs` object (newer spelling of the `guided_*` fields)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _Sampling(_Body):
    """Fields both endpoints share: sampling, stopping, penalties, structured outputs."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = None
    ignore_eos: bool | None = None
    return_token_ids: bool | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None
    # refused by name in protocol.py when set (their loss would change the answer)
    best_of: int | None = None
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    tool_choice: Any = None


class CompletionRequest(_Sampling):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str] | list[list[int]] | None = None
    echo: bool | None = None
    logprobs: int | None = None
    suffix: str | None = None


class ChatMessage(_Body):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


def describe(error: ValidationError) -> tuple[str, str | None]:
    """A pydantic error as one sentence a client can act on, and the field it is about."""
    first = error.errors()[0]
    loc = [str(p) for p in first["loc"]]
    field = loc[0] if loc else None
    value = first.get("input")
    if first["type"] == "missing":
        return f"{'.'.join(loc)} is required", field
    if field in FIELD_WORDS and len(loc) <= 2:
        return f"{field} must be {FIELD_WORDS[field]}, got {value!r}", field
    kind = first["type"]
    words = {
        "int_type": "an integer",
        "int_parsing": "an integer",
        "int_from_float": "an integer",
        "float_type": "a number",
        "float_parsing": "a number",
        "bool_type": "true or false",
        "bool_parsing": "true or false",
        "string_type": "a string",
        "list_type": "a list",
        "dict_type": "an object",
        "model_type": "an object",
        "literal_error": first.get("ctx", {}).get("expected", "one of the documented values"),
    }.get(kind)
    # pydantic names the union member it tried in the location ("str", "dict[str,any]"): drop it
    path = ".".join(p for p in loc if p not in ("str", "int", "bool", "float") and "[" not in p)
    if words is not None:
        return f"{path} must be {words}, got {value!r}", field
    return f"{path}: {first['msg']}", field
