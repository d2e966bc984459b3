"""Bounded, non-blocking intake of requests: the body size limit and the tokenizer pool.

``BodyLimit`` (ASGI middleware) ends a request whose body is over ``--max-request-body`` with a
413 while it is read: at once when its Content-Length says so, else as soon as the bytes
received pass the limit, so no more than the limit is ever held. ``Preparer`` runs parsing,
chat templating and tokenizing on ``--tokenizer-threads`` threads, off the event loop that
answers /health and streams tokens, keeping a thread free of large prompts, and answers a
preparation that takes longer than ``PREPARE_TIMEOUT`` with a 413.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dsinfer.gateway.errors import APIError, overloaded, payload_too_large, prepare_timed_out

LARGE_BODY = 256 * 1024  # bytes: a body over this (a prompt of ~64K tokens or more) is "large"
MAX_WAITING_LARGE = 2  # large requests waiting per place, before 429
RETRY_AFTER = 1.0
# seconds a request's parsing, templating and tokenizing may take; a prompt under the length
# limits takes well under one (163K DeepSeek tokens: ~0.3 s), one of several MB much longer
PREPARE_TIMEOUT = 5.0

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
    like any other, and each takes a thread for a millisecond or so).

    A preparation still running ``timeout`` seconds after its thread took it up is answered with
    a 413 at once. Its thread cannot be stopped (the tokenizer is native code): it keeps its
    place, and counts as waiting, until it ends."""

    def __init__(self, threads: int, max_waiting: int, timeout: float = PREPARE_TIMEOUT) -> None:
        self.threads = max(2, threads)
        self.timeout = timeout
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
            if large:
                await self._large.acquire()
        except BaseException:
            self.pending[large] -= 1
            raise
        try:
            started, work = self._submit(fn)
        except BaseException:
            self._release(large)
            raise
        work.add_done_callback(lambda done: self._finished(done, large))
        await asyncio.shield(started)
        try:
            return await asyncio.wait_for(asyncio.shield(work), self.timeout)
        except TimeoutError:
            raise prepare_timed_out(self.timeout) from None

    def _submit(self, fn: Callable[[], T]) -> tuple[asyncio.Future[None], asyncio.Future[T]]:
        """-> (done when a thread takes ``fn`` up, done when ``fn`` returns)."""
        loop = asyncio.get_running_loop()
        started: asyncio.Future[None] = loop.create_future()

        def timed() -> T:
            with contextlib.suppress(RuntimeError):  # a closed loop: the server is ending
                loop.call_soon_threadsafe(_set_once, started)
            return fn()

        work = loop.run_in_executor(self._pool, timed)
        work.add_done_callback(lambda _: _set_once(started))  # also when cancelled before it started
        return started, work

    def preparing(self) -> int:
        """Requests waiting for a tokenizer thread or being prepared on one."""
        return self.pending[True] + self.pending[False]

    def _finished(self, work: asyncio.Future[Any], large: bool) -> None:
        if not work.cancelled():
            work.exception()  # an abandoned preparation's error is no one's to log
        self._release(large)

    def _release(self, large: bool) -> None:
        self.pending[large] -= 1
        if large:
            self._large.release()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _set_once(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
