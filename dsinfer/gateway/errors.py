"""Errors in OpenAI's format: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import math
from typing import Any

from fastapi.responses import JSONResponse

INVALID_REQUEST = "invalid_request_error"


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


def overloaded(message: str, retry_after: float) -> APIError:
    seconds = max(1, math.ceil(retry_after)) if math.isfinite(retry_after) else 1
    return APIError(
        429,
        message,
        type="rate_limit_error",
        code="rate_limit_exceeded",
        headers={"Retry-After": str(seconds)},
    )


def unavailable(message: str) -> APIError:
    return APIError(503, message, type="service_unavailable_error", code="service_unavailable")


def server_error(message: str) -> APIError:
    return APIError(500, message, type="server_error", code="internal_error")


def timeout_error(seconds: float) -> APIError:
    return APIError(504, f"request timed out after {seconds:g} s", type="timeout_error", code="timeout")
