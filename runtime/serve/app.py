"""The OpenAI-compatible ASGI app (FastAPI) over one engine: what uvicorn and Ray Serve both run.

`make_app(model, engine, settings)` returns a FastAPI app; `runtime/serve/server.py` runs it with
uvicorn, `runtime/serve/ray.py` deploys the same object with Ray Serve (`@serve.ingress`). The
engine keeps its own worker thread; a request's coroutine submits to it and awaits its events
through `bridge.merged_events` (no thread per request, no polling).

Every failure becomes an OpenAI error body with a status (400 bad input, 401 bad key, 404/405
routing, 408 a body that stalls, 413 an oversized body, 431 oversized headers, 500 engine
error, 503 a full queue, a shutdown or a closed engine (with Retry-After), 504 past the
request timeout): nothing a client sends can stop the server or show a traceback. `/ready`
tells a load balancer whether new requests are taken (503 while the queue is full or the
server drains; the port opens only once the model is loaded). A
client that goes away (mid-stream, or while waiting for a whole answer) has its requests
cancelled, so the engine stops working for nobody.
"""

from __future__ import annotations

import hmac
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from specport.core.chat_template import load_chat_template
from specport.core.errors import InputError
from specport.runtime.engine.base import Engine
from specport.runtime.serve.api_error import APIError, error_body
from specport.runtime.serve.generate import generate
from specport.runtime.serve.guard import ClientTimeouts, read_body
from specport.runtime.serve.metrics import Metrics
from specport.runtime.serve.openapi import openapi_document
from specport.runtime.serve.protocol import parse_chat, parse_completion, parse_json_body
from specport.runtime.serve.responses import TokenText, model_card, models_list
from specport.runtime.serve.served import ServedModel
from specport.runtime.serve.state import AppState, ServeSettings, log_access

__all__ = ["make_app"]

logger = logging.getLogger(__name__)


def make_app(model: Any, engine: Engine, settings: ServeSettings | None = None) -> FastAPI:
    """The FastAPI app serving `model` through `engine` (the caller owns and closes the engine)."""
    settings = settings or ServeSettings()
    served = ServedModel(
        settings.model_name or model.path.name,
        model,
        engine_max_length=getattr(engine, "max_length", None),
        logprobs=bool(getattr(engine, "logprobs", True)),
        speculative=bool(getattr(engine, "speculative", None)),
        max_tokens=settings.max_tokens,
    )
    if settings.chat_template is not None and model.tokenizer is None:
        raise InputError(
            f"--chat-template needs a tokenizer but {model.path} has none; serve an artifact "
            "exported with its tokenizer, or send token-id prompts to /v1/completions"
        )
    template = load_chat_template(model, settings.chat_template)
    state = AppState(
        served, engine, template, settings, Metrics(served.name, engine), TokenText(model)
    )
    app = FastAPI(title="specport", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.specport = state
    app.add_middleware(ClientTimeouts, settings=settings)
    if settings.cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.cors_origins),
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["Authorization", "Content-Type"],
        )
    _routes(app, state)
    _handlers(app, state)
    return app


def _routes(app: FastAPI, state: AppState) -> None:
    served = state.served

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": served.name, **state.stats()}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        """For a load balancer: 200 while new requests are taken, else 503 and why."""
        why = state.not_ready()
        if why is None:
            return JSONResponse({"status": "ready", "queued": state.queued()})
        return JSONResponse(
            {"status": "not ready", "reason": why},
            status_code=503,
            headers={"Retry-After": str(state.settings.retry_after_s)},
        )

    @app.get("/openapi.json")
    async def openapi() -> dict[str, Any]:
        return openapi_document()

    @app.get("/metrics")
    async def metrics() -> Response:
        data, content_type = state.metrics.scrape()
        return Response(data, media_type=content_type)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        _authorize(request, state)
        return models_list(served)

    @app.get("/v1/models/{name:path}")
    async def model(name: str, request: Request) -> dict[str, Any]:
        _authorize(request, state)
        if name != served.name:
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves {served.name!r}",
                code="model_not_found",
                type="not_found_error",
            )
        return model_card(served)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        _authorize(request, state)
        body = parse_json_body(await read_body(request, state.settings))
        return await generate(request, state, "/v1/completions", parse_completion(body, served))

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        _authorize(request, state)
        body = parse_json_body(await read_body(request, state.settings))
        parsed = parse_chat(body, served, state.chat_template)
        return await generate(request, state, "/v1/chat/completions", parsed)


def _handlers(app: FastAPI, state: AppState) -> None:
    routes = "/v1/models, /v1/completions, /v1/chat/completions, /health, /ready, /metrics"

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        state.counters["errors"] += 1
        if exc.status >= 500:
            logger.error("%s %s: %s", request.method, request.url.path, exc.message)
        headers = dict(exc.headers or {})
        if exc.status in (408, 413, 431):
            headers["Connection"] = "close"
        log_access(request, exc.status, None)
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers or None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        state.counters["errors"] += 1
        path = request.url.path
        if exc.status_code == 404:
            message, kind = f"no route {path!r}; see {routes}", "not_found_error"
        elif exc.status_code == 405:
            allowed = (exc.headers or {}).get("Allow", "")
            message = f"{request.method} is not allowed on {path}; use {allowed}"
            kind = "invalid_request_error"
        else:
            message, kind = str(exc.detail), "invalid_request_error"
        log_access(request, exc.status_code, None)
        return JSONResponse(
            error_body(message, kind), status_code=exc.status_code, headers=exc.headers
        )


def _authorize(request: Request, state: AppState) -> None:
    key = state.settings.api_key
    if key is None:
        return
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise APIError(
            401,
            "missing or wrong API key: send the header `Authorization: Bearer <key>` with the "
            "key this server was started with (--api-key)",
            type="invalid_request_error",
            code="invalid_api_key",
        )
