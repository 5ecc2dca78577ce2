"""The rules for single request fields: sampling parameters, stop strings, logprobs, refused
fields and structured-output constraints.

Each function takes the validated pydantic request (`schemas.py`) and returns what the engine
needs, or raises `APIError` (400, naming the field) with what to send instead. `protocol.py`
assembles them into engine requests.
"""

from __future__ import annotations

from typing import Any

from specport.core.errors import InputError, SpecportError
from specport.runtime.sampler import SamplingConfig
from specport.runtime.serve.api_error import APIError
from specport.runtime.serve.schemas import _Sampling
from specport.runtime.serve.served import ServedModel

MAX_TOP_LOGPROBS = 20  # OpenAI's limit
MAX_STOP = 4  # OpenAI's limit on stop sequences
MAX_LOGIT_BIAS = 300  # token ids one request may bias (each costs the sampler every step)


_REFUSED = {
    "suffix": "suffix (insertion) is not supported by specport serve",
    "tools": "tools / function calling are not supported by specport serve",
    "functions": "function calling is not supported by specport serve",
}


def refuse_unsupported(req: _Sampling) -> None:
    for name, why in _REFUSED.items():
        value = getattr(req, name, None)
        if value not in (None, [], {}, ""):
            raise APIError(400, why, param=name, code="unsupported")
    if req.tool_choice not in (None, "none"):
        raise APIError(400, _REFUSED["tools"], param="tool_choice", code="unsupported")
    if req.best_of not in (None, 1) and req.best_of != req.n:
        raise APIError(
            400,
            "best_of other than n is not supported; use n for several choices",
            param="best_of",
            code="unsupported",
        )


def sampling_config(req: _Sampling, vocab: int) -> SamplingConfig:
    temperature = 1.0 if req.temperature is None else req.temperature
    if temperature < 0:
        raise APIError(
            400, f"temperature must be >= 0 (0 = greedy), got {temperature}", param="temperature"
        )
    bias: dict[int, float] = {}
    if len(req.logit_bias or {}) > MAX_LOGIT_BIAS:
        raise APIError(
            400,
            f"logit_bias may bias at most {MAX_LOGIT_BIAS} tokens, got {len(req.logit_bias or {})}",
            param="logit_bias",
        )
    for key, value in (req.logit_bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise APIError(
                400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias"
            ) from None
        if not 0 <= token < vocab:
            raise APIError(
                400,
                f"logit_bias token id {token} is outside the vocabulary (0..{vocab - 1})",
                param="logit_bias",
            )
        if not -100 <= value <= 100:
            raise APIError(
                400, f"logit_bias values must be in [-100, 100], got {value}", param="logit_bias"
            )
        bias[token] = float(value)
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        if value is not None and not -2.0 <= value <= 2.0:
            raise APIError(400, f"{name} must be in [-2, 2], got {value}", param=name)
    config = SamplingConfig(
        greedy=temperature == 0.0,
        temperature=temperature if temperature > 0 else 1.0,
        top_k=0 if req.top_k in (None, -1) else req.top_k,  # -1: vLLM's spelling of "off"
        top_p=1.0 if req.top_p is None else req.top_p,
        min_p=req.min_p or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        logit_bias=tuple(sorted(bias.items())),
        seed=req.seed,
    )
    try:
        return config.validate()
    except SpecportError as e:
        raise APIError(400, str(e)) from None


def stop_strings(req: _Sampling) -> tuple[str, ...]:
    if req.stop is None:
        return ()
    stops = [req.stop] if isinstance(req.stop, str) else req.stop
    if len(stops) > MAX_STOP:
        raise APIError(
            400, f"stop may hold at most {MAX_STOP} strings, got {len(stops)}", param="stop"
        )
    if not all(stops):
        raise APIError(
            400,
            f"stop must be a non-empty string or a list of them, got {req.stop!r}",
            param="stop",
        )
    return tuple(stops)


def logprobs_k(kind: str, req: Any, served: ServedModel) -> int | None:
    if kind == "chat":
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        k = (req.top_logprobs or 0) if req.logprobs else None
        param = "top_logprobs"
    else:
        k, param = req.logprobs, "logprobs"
    if k is None:
        return None
    if not 0 <= k <= MAX_TOP_LOGPROBS:
        raise APIError(400, f"{param} must be in 0..{MAX_TOP_LOGPROBS}, got {k}", param=param)
    if not served.logprobs:
        raise APIError(
            400,
            "this server's engine does not report logprobs; serve with `specport serve` "
            "(either engine reports them)",
            param=param,
            code="unsupported",
        )
    return k


def _structured(req: _Sampling) -> tuple[str, Any, str] | None:
    """(kind, spec, field) of the one structured-output field set, if any."""
    found: list[tuple[str, Any, str]] = []
    fmt = req.response_format
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise APIError(
                    400,
                    'response_format {"type": "json_schema"} needs json_schema.schema',
                    param="response_format",
                )
            found.append(("json_schema", fmt.json_schema.schema_, "response_format"))
        elif fmt.type == "json_object":
            found.append(("json_object", None, "response_format"))
        else:
            raise APIError(
                400,
                f"response_format type {fmt.type!r} is not supported; use json_schema or "
                "json_object, or the guided_regex / guided_grammar fields",
                param="response_format",
            )
    for kind, name in (
        ("json_schema", "guided_json"),
        ("regex", "guided_regex"),
        ("choice", "guided_choice"),
        ("grammar", "guided_grammar"),
    ):
        value = getattr(req, name)
        if value is not None:
            found.append((kind, value, name))
    so = req.structured_outputs
    if so is not None:
        for kind, value in (
            ("json_schema", so.json_),
            ("regex", so.regex),
            ("choice", so.choice),
            ("grammar", so.grammar),
            ("json_object", True if so.json_object else None),
        ):
            if value is not None:
                found.append((kind, None if kind == "json_object" else value, "structured_outputs"))
    if len(found) > 1:
        names = ", ".join(sorted({f for _, _, f in found}))
        raise APIError(400, f"give one structured-output constraint, got several ({names})")
    return found[0] if found else None


def grammar(req: _Sampling, served: ServedModel, greedy: bool) -> Any:
    """The compiled grammar the request asks for (None: unconstrained)."""
    wanted = _structured(req)
    if wanted is None:
        return None
    kind, spec, name = wanted
    if served.model.tokenizer is None:
        raise APIError(
            400,
            "structured outputs need the model's tokenizer, and this artifact has none",
            param=name,
        )
    if served.speculative and not greedy:
        raise APIError(
            400,
            "structured outputs with speculative decoding need temperature 0 (greedy); "
            "send temperature 0, or serve without --speculative for sampled constrained "
            "requests",
            param=name,
            code="unsupported",
        )
    try:
        return served.grammars().compile(kind, spec)
    except InputError as e:
        raise APIError(400, str(e), param=name) from None
