"""Bounded, non-blocking intake of requests: the body size limit and the tokenizer pool.

``BodyLimit`` (ASGI middleware) ends a request whose body is over ``--max-request-body`` with a
413 while it is read: at once when its Content-Length says so, else as soon as the bytes
received pass the limit, so no more than the limit is ever held. ``Preparer`` runs parsing,
chat templating and tokenizing on ``--tokenizer-threads`` threads, off the event loop that
answers /health and streams tokens, keeping a thread free of large prompts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dsinfer.gateway.errors import APIError, overloaded, payload_too_large

LARGE_BODY = 256 * 1024  # bytes: a body over this (a prompt of ~64K tokens or more) is "large"
MAX_WAITING_LARGE = 2  # large requests waiting per place, before 429
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
    """``threads`` threads (at least 2) prepare requests. A large body (over ``LARGE_BODY``) holds
    one of ``threads - 1`` places while it waits for and uses a thread, so one thread is always
    there for the others: a short request never waits behind a multi-MB prompt being tokenized.
    Too many waiting -> 429: large ones past ``MAX_WAITING_LARGE`` per place; others past
    ``max_waiting`` (the gateway's ``--max-queued-requests``: a burst of short requests is a queue
    like any other, and each takes a thread for a millisecond or so)."""

    def __init__(self, threads: int, max_waiting: int) -> None:
        self.threads = max(2, threads)
        self._large = asyncio.Semaphore(self.threads - 1)
        self._limits = {True: (self.threads - 1) * (1 + MAX_WAITING_LARGE), False: max_waiting}
        self.pending = {True: 0, False: 0}  # large?, -> requests waiting or being prepared
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="tokenize")

    async def run(self, fn: Callable[[], T], body_bytes: int) -> T:
        large = body_bytes > LARGE_BODY
        if self.pending[large] >= self._limits[large]:
            raise overloaded(
                f"{self.pending[large]} {'large ' if large else ''}requests are waiting to be tokenized "
                f"({self.threads} tokenizer threads, --tokenizer-threads)",
                RETRY_AFTER,
            )
        self.pending[large] += 1
        try:
            if not large:
                return await asyncio.get_running_loop().run_in_executor(self._pool, fn)
            async with self._large:
                return await asyncio.get_running_loop().run_in_executor(self._pool, fn)
        finally:
            self.pending[large] -= 1

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
