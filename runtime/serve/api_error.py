"""The error a request is answered with: an HTTP status and OpenAI's error object.

Raised anywhere in the serving path (parsing, limits, the engine's refusal) and turned into a
JSON body by the app's exception handler, so a client never sees a Python traceback.
"""

from __future__ import annotations

from typing import Any


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
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.headers = headers  # e.g. Retry-After on an overloaded server's 503
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
