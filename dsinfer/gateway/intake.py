"""Bounded, non-blocking intake of requests: the body size limit and the tokenizer pool.

``BodyLimit`` (ASGI middleware) ends a request whose body is over ``--max-request-body`` with a
413 while it is read: at once when its Content-Length says so, else as soon as the bytes
received pass the limit, so no more than the limit is ever held. ``Preparer`` runs parsing,
chat templating and tokenizing on ``--tokenizer-threads`` threads, off the event loop that
answers /health and streams tokens; when that many requests are being prepared and
``MAX_WAITING_PER_THREAD`` per thread wait, a new one gets 429.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dsinfer.gateway.errors import APIError, overloaded, payload_too_large

MAX_WAITING_PER_THREAD = 16  # requests waiting for a tokenizer thread, per thread, before 429
RETRY_AFTER = 1.0

T = TypeVar("T")


class BodyTooLarge(StarletteHTTPException):
    """Raised from ``receive`` once the body passed the limit. An HTTPException, so that body
    parsing (FastAPI's included) lets it through as it is; the app answers with ``error``."""

    def __init__(self, limit: int) -> None:
        self.error: APIError = payload_too_large(limit)
        super().__init__(413, self.error.message, headers=self.error.headers)


class BodyLimit:
    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = _content_length(scope)
        if length is not None and length > self.limit:
            await payload_too_large(self.limit).response()(scope, receive, send)
            return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise BodyTooLarge(self.limit)
            return message

        await self.app(scope, limited, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


class Preparer:
    def __init__(self, threads: int, max_waiting_per_thread: int = MAX_WAITING_PER_THREAD) -> None:
        self.threads = threads
        self.limit = threads * (1 + max_waiting_per_thread)
        self.pending = 0
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="tokenize")

    async def run(self, fn: Callable[[], T]) -> T:
        if self.pending >= self.limit:
            raise overloaded(
                f"{self.pending} requests are waiting to be tokenized ({self.threads} tokenizer "
                "threads, --tokenizer-threads)",
                RETRY_AFTER,
            )
        self.pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn)
        finally:
            self.pending -= 1

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
