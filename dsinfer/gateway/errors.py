"""Errors in OpenAI's format: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import math
import re
from typing import Any

from fastapi.responses import JSONResponse

INVALID_REQUEST = "invalid_request_error"
UNAVAILABLE_RETRY_AFTER = 5.0  # seconds a 503 asks the client to wait (a pool restarts in seconds)
# An absolute file path (two or more components): what a library's error may quote.
_PATH = re.compile(r"(?<![\w:/.~-])(?:/[\w.@+~-]+){2,}/?")


class APIError(Exception):
    """Ends a request with an HTTP status and an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(
    message: str, *, type: str = INVALID_REQUEST, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def retry_after(seconds: float) -> dict[str, str]:
    """The Retry-After header: whole seconds, at least 1."""
    return {"Retry-After": str(max(1, math.ceil(seconds)) if math.isfinite(seconds) else 1)}


def overloaded(message: str, seconds: float) -> APIError:
    return APIError(
        429, message, type="rate_limit_error", code="rate_limit_exceeded", headers=retry_after(seconds)
    )


def unavailable(message: str, seconds: float = UNAVAILABLE_RETRY_AFTER) -> APIError:
    return APIError(
        503,
        message,
        type="service_unavailable_error",
        code="service_unavailable",
        headers=retry_after(seconds),
    )


def payload_too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"the request body is larger than {limit} bytes, this server's limit (--max-request-body)",
        code="request_too_large",
        headers={"Connection": "close"},
    )


def prepare_timed_out(seconds: float) -> APIError:
    return APIError(
        413,
        f"the prompt took more than {seconds:g} s to template and tokenize, this server's limit; shorten it",
        code="prompt_too_large",
    )


def without_paths(message: str) -> str:
    """``message`` with any absolute file path replaced: text from a worker or a library may
    name the server's files, which a client must not see."""
    return _PATH.sub("<path>", message)


def server_error(message: str) -> APIError:
    return APIError(500, message, type="server_error", code="internal_error")


def timeout_error(seconds: float) -> APIError:
    return APIError(504, f"request timed out after {seconds:g} s", type="timeout_error", code="timeout")
