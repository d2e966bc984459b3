"""The gateway's control socket: one ZMQ ROUTER bound at the control address (the pools'
``--gateway-addr``). Every message to and from the ranks goes through it: frames in are decoded
and handed to ``on_message``; a message the socket cannot deliver (the rank is gone, its queue
is full) is handed to ``on_undeliverable`` with the rank's name."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio

from dsinfer.base.protocol import Message, decode, encode

log = logging.getLogger("dsinfer.gateway")


class ControlSocket:
    def __init__(
        self,
        addr: str,
        on_message: Callable[[Message], None],
        on_undeliverable: Callable[[str, msgspec.Struct], None],
    ) -> None:
        self.addr = addr
        self._on_message, self._on_undeliverable = on_message, on_undeliverable
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted rank takes its name back
        self._sock.bind(f"tcp://{self.addr}")
        self._task = asyncio.create_task(self._receive())
        log.info("control socket listening on %s", self.addr)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._sock is not None:
            self._sock.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()

    def send(self, worker: str, message: msgspec.Struct) -> None:
        assert self._sock is not None
        sent = self._sock.send_multipart([worker.encode(), encode(message)], flags=zmq.NOBLOCK)
        # zmq.asyncio reports a failed send on the returned future, not by raising
        sent.add_done_callback(lambda f: self._sent(f, worker, message))

    def _sent(self, future: asyncio.Future[object], worker: str, message: msgspec.Struct) -> None:
        error = None if future.cancelled() else future.exception()
        if error is not None:
            log.warning("cannot reach %s (%s); %s not delivered", worker, error, type(message).__name__)
            self._on_undeliverable(worker, message)

    async def _receive(self) -> None:
        assert self._sock is not None
        while True:
            frames = await self._sock.recv_multipart()
            if len(frames) != 2:
                continue
            try:
                message = decode(frames[1])
            except (msgspec.DecodeError, ValueError) as e:
                log.error("dropped an undecodable message from %r: %s", frames[0], e)
                continue
            try:
                self._on_message(message)
            except Exception:
                log.exception("error handling %s", type(message).__name__)
