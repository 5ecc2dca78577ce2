"""The server's OpenAPI document, built from the pydantic request models (`schemas.py`).

The routes read their bodies themselves (`guard.read_body`: size and time limits first), so
FastAPI cannot see what they take; this document says it instead, from the same models that
validate the bodies, so it cannot drift from what the server checks. `GET /openapi.json` serves
it, and the fuzz tests generate their requests from it (schemathesis).
"""

from __future__ import annotations

from functools import cache
from typing import Any

from pydantic.json_schema import models_json_schema

from specport.runtime.serve.fields import MAX_LOGIT_BIAS, MAX_STOP, MAX_TOP_LOGPROBS
from specport.runtime.serve.protocol import MAX_N
from specport.runtime.serve.schemas import ChatCompletionRequest, CompletionRequest

# The limits the rules in fields.py / protocol.py enforce, stated on the schema too, so a client
# (and a fuzzer) sees them: {field: JSON-schema keywords for its non-null form}.
BOUNDS: dict[str, dict[str, Any]] = {
    "max_tokens": {"minimum": 1},
    "max_completion_tokens": {"minimum": 1},
    "temperature": {"minimum": 0},
    "top_p": {"exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"minimum": -1},
    "min_p": {"minimum": 0, "maximum": 1},
    "presence_penalty": {"minimum": -2, "maximum": 2},
    "frequency_penalty": {"minimum": -2, "maximum": 2},
    "repetition_penalty": {"exclusiveMinimum": 0},
    "n": {"minimum": 1, "maximum": MAX_N},
    "logit_bias": {"maxProperties": MAX_LOGIT_BIAS},
    "top_logprobs": {"minimum": 0, "maximum": MAX_TOP_LOGPROBS},
    "logprobs": {"minimum": 0, "maximum": MAX_TOP_LOGPROBS},  # completions' integer form
    "seed": {"minimum": 0},
}

_ERROR = {
    "description": "an OpenAI error object",
    "content": {
        "application/json": {
            "schema": {
                "type": "object",
                "required": ["error"],
                "properties": {
                    "error": {
                        "type": "object",
                        "required": ["message", "type", "param", "code"],
                        "properties": {
                            "message": {"type": "string"},
                            "type": {"type": "string"},
                            "param": {"type": ["string", "null"]},
                            "code": {"type": ["string", "null"]},
                        },
                    }
                },
            }
        }
    },
}


def _post(ref: dict[str, Any], summary: str) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": ref}}},
            "responses": {
                "200": {"description": "the answer (JSON, or an SSE stream with stream: true)"},
                "400": _ERROR,
                "404": _ERROR,
                "413": _ERROR,
                "429": _ERROR,
                "503": _ERROR,
            },
        }
    }


def _get(summary: str) -> dict[str, Any]:
    return {"get": {"summary": summary, "responses": {"200": {"description": summary}}}}


def _bound(props: dict[str, Any]) -> None:
    for name, keywords in BOUNDS.items():
        for form in props.get(name, {}).get("anyOf", []):
            if form.get("type") in ("integer", "number", "object"):
                form.update(keywords)
    for form in props.get("stop", {}).get("anyOf", []):
        if form.get("type") == "string":
            form["minLength"] = 1
        elif form.get("type") == "array":
            form.update(maxItems=MAX_STOP, items={"type": "string", "minLength": 1})
    for form in props.get("prompt", {}).get("anyOf", []):
        if form.get("items") == {"type": "integer"}:
            form["items"] = {"type": "integer", "minimum": 0}
            form["minItems"] = 1
    for form in props.get("messages", {}).get("anyOf", []):
        if form.get("type") == "array":
            form["minItems"] = 1


@cache
def openapi_document() -> dict[str, Any]:
    """OpenAPI 3.1 for /v1/completions, /v1/chat/completions and the GET routes."""
    refs, defs = models_json_schema(
        [(CompletionRequest, "validation"), (ChatCompletionRequest, "validation")],
        ref_template="#/components/schemas/{model}",
    )
    for name, needed in (("CompletionRequest", "prompt"), ("ChatCompletionRequest", "messages")):
        _bound(defs["$defs"][name]["properties"])
        defs["$defs"][name]["required"] = [needed]  # optional in the model for its own message
    return {
        "openapi": "3.1.0",
        "info": {"title": "specport", "version": "1"},
        "paths": {
            "/v1/completions": _post(refs[(CompletionRequest, "validation")], "text completion"),
            "/v1/chat/completions": _post(
                refs[(ChatCompletionRequest, "validation")], "chat completion"
            ),
            "/v1/models": _get("the served model"),
            "/health": _get("liveness and counters"),
            "/ready": _get("200 when the server takes new requests, else 503"),
            "/metrics": _get("Prometheus metrics"),
        },
        "components": {"schemas": defs["$defs"]},
    }
