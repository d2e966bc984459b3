"""A rank's control-plane sockets: a DEALER to the gateway, a PULL inbox for peer ranks, and one
PUSH per peer inbox it writes to. Messages are protocol structs; nothing else goes through."""

from __future__ import annotations

import contextlib
import logging
import threading

import msgspec
import zmq

from dsinfer.base.protocol import Message, decode, encode

log = logging.getLogger("dsinfer.worker")

SEND_HWM = 10_000  # queued outgoing messages per socket before send raises (peer gone for long)


class WorkerChannel:
    def __init__(self, worker: str, gateway_addr: str, host: str) -> None:
        self.worker = worker
        self._ctx = zmq.Context()
        self._gateway = self._ctx.socket(zmq.DEALER)
        self._gateway.setsockopt(zmq.IDENTITY, worker.encode())
        self._gateway.setsockopt(zmq.LINGER, 0)
        self._gateway.setsockopt(zmq.SNDHWM, SEND_HWM)
        self._gateway.connect(f"tcp://{gateway_addr}")
        self._inbox = self._ctx.socket(zmq.PULL)
        self._inbox.setsockopt(zmq.LINGER, 0)
        port = self._inbox.bind_to_random_port(f"tcp://{host}")
        self.inbox_addr = f"tcp://{host}:{port}"
        self._peers: dict[str, zmq.Socket] = {}
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        self._poller = zmq.Poller()
        self._poller.register(self._gateway, zmq.POLLIN)
        self._poller.register(self._inbox, zmq.POLLIN)

    def send_gateway(self, message: msgspec.Struct) -> None:
        try:
            self._gateway.send(encode(message), zmq.NOBLOCK)
        except zmq.Again:
            log.warning("gateway socket full; dropped %s", type(message).__name__)

    def send_peer(self, inbox: str, message: msgspec.Struct) -> None:
        sock = self._peers.get(inbox)
        if sock is None:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, SEND_HWM)
            sock.connect(inbox)
            self._peers[inbox] = sock
        try:
            sock.send(encode(message), zmq.NOBLOCK)
        except zmq.Again:
            log.warning("peer %s unreachable; dropped %s", inbox, type(message).__name__)

    def receive(self, timeout_ms: int) -> list[Message]:
        """Every message waiting (gateway first), blocking up to ``timeout_ms`` for the first."""
        messages: list[Message] = []
        events = dict(self._poller.poll(timeout_ms))
        for sock in (self._gateway, self._inbox):
            if sock not in events:
                continue
            while True:
                try:
                    frame = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    messages.append(decode(frame))
                except (msgspec.DecodeError, ValueError) as e:
                    log.error("dropped an undecodable control message: %s", e)
        return messages

    def start_heartbeat(self, gateway_addr: str, message: msgspec.Struct, interval: float) -> None:
        """A daemon thread with its own socket sends ``message`` every ``interval`` seconds."""
        frame = encode(message)

        def beat() -> None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://{gateway_addr}")
            try:
                while not self._stop.wait(interval):
                    with contextlib.suppress(zmq.Again):
                        sock.send(frame, zmq.NOBLOCK)
            finally:
                sock.close(linger=0)

        self._beat = threading.Thread(target=beat, name="heartbeat", daemon=True)
        self._beat.start()

    def close(self) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join(timeout=5)
        for sock in [self._gateway, self._inbox, *self._peers.values()]:
            sock.close(linger=0)
        self._ctx.term()
