"""The gateway's control socket: one ZMQ ROUTER bound at the control address (the pools'
``--gateway-addr``). Every message to and from the ranks goes through it: frames in are decoded
and handed to ``on_message`` with the sender's ROUTER identity (a rank's worker name, its
heartbeat's or its launcher's name: dsinfer/base/protocol.py); a message the socket cannot
deliver (the rank is gone, its queue is full) is handed to ``on_undeliverable`` with the rank's
name. The socket is a CURVE server (dsinfer/base/control_auth.py): only peers holding the
cluster secret get through, the others are logged."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from dsinfer.base.cluster_secret import ControlKeys
from dsinfer.base.control_auth import HANDSHAKE_EVENTS, HandshakeLog, serve_curve, start_authenticator
from dsinfer.base.protocol import encode
from dsinfer.connector.messages import AnyMessage, decode

log = logging.getLogger("dsinfer.gateway")


class ControlSocket:
    def __init__(
        self,
        addr: str,
        keys: ControlKeys,
        on_message: Callable[[str, AnyMessage], None],
        on_undeliverable: Callable[[str, msgspec.Struct], None],
    ) -> None:
        self.addr = addr
        self._keys = keys
        self._on_message, self._on_undeliverable = on_message, on_undeliverable
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._auth: ThreadAuthenticator | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.handshakes = HandshakeLog(f"the control socket {addr}", server=True)

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._auth = start_authenticator(self._ctx, self._keys)
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted rank takes its name back
        serve_curve(self._sock, self._keys.gateway)
        self._monitor = self._sock.get_monitor_socket(HANDSHAKE_EVENTS)
        self._sock.bind(f"tcp://{self.addr}")
        self._tasks = [asyncio.create_task(self._receive()), asyncio.create_task(self._watch_handshakes())]
        log.info("control socket listening on %s (CURVE)", self.addr)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._sock is not None:
            self._sock.disable_monitor()
            self._sock.close(linger=0)
        if self._monitor is not None:
            self._monitor.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
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
            sender = frames[0].decode(errors="replace")
            try:
                message = decode(frames[1])
            except (msgspec.DecodeError, ValueError) as e:
                log.error("dropped an undecodable message from %r: %s", sender, e)
                continue
            try:
                self._on_message(sender, message)
            except Exception:
                log.exception("error handling %s from %s", type(message).__name__, sender)

    async def _watch_handshakes(self) -> None:
        assert self._monitor is not None
        while True:
            self.handshakes.event(await recv_monitor_message(self._monitor))
