"""CURVE on every control-plane socket, and the log lines of handshakes that fail.

A listening socket (the gateway's ROUTER, a rank's inbox) is a CURVE server with its key pair
from ``ControlKeys``; a ZAP authenticator in its process lets through only clients that present
the client key, so a peer without the cluster secret cannot complete a handshake: it can neither
send a message nor read one (CURVE also encrypts the traffic). Every socket gets
``ZMQ_MAXMSGSIZE``: a peer sending a larger frame is disconnected before the frame is stored.

Failed handshakes are seen through a socket monitor (ZAP never hears of a peer that does not
speak CURVE at all) and logged by ``HandshakeLog``: one line, then at most one per interval with
the count in between.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator

from dsinfer.base.cluster_secret import ControlKeys, KeyPair
from dsinfer.base.protocol import MAX_MESSAGE_BYTES

log = logging.getLogger("dsinfer.auth")

HANDSHAKE_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
LOG_INTERVAL = 10.0  # seconds between two lines about failed handshakes of one socket
_MECHANISM_MISMATCH = 0x11000001  # ZMQ_PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH


def serve_curve(sock: zmq.Socket, pair: KeyPair) -> None:
    """Make ``sock`` a CURVE server with ``pair`` (before it binds)."""
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, pair.secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, pair.public)


def connect_curve(sock: zmq.Socket, keys: ControlKeys, server: KeyPair) -> None:
    """Make ``sock`` a CURVE client of ``server`` with the client key pair (before it connects)."""
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    sock.setsockopt(zmq.CURVE_SERVERKEY, server.public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.client.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.client.secret)


class _ClientKey:
    """ZAP credentials check: the one client key the cluster secret yields."""

    def __init__(self, allowed: bytes) -> None:
        self.allowed = allowed

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.allowed


def start_authenticator(ctx: zmq.Context[Any], keys: ControlKeys) -> ThreadAuthenticator:
    """The ZAP handler of ``ctx`` (one per process, started before any CURVE server binds)."""
    auth = ThreadAuthenticator(ctx, log=logging.getLogger("dsinfer.auth.zap"))
    auth.start()
    auth.configure_curve_callback("*", credentials_provider=_ClientKey(keys.client.public))
    return auth


def _reason(event: int, value: int) -> str:
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return f"its key was refused (ZAP status {value})"
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        if value == _MECHANISM_MISMATCH:
            return "it does not speak CURVE"
        return f"ZMTP protocol error {value:#x}"
    return "the CURVE handshake failed (another key)"


class HandshakeLog:
    """Log lines for one socket's handshake events (``server``: peers connect to it).

    ``event`` takes a parsed monitor message and returns True for a successful handshake."""

    def __init__(
        self,
        what: str,
        *,
        server: bool,
        interval: float = LOG_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.what, self.server = what, server
        self.interval, self._clock = interval, clock
        self._last_line = -float("inf")
        self._suppressed = 0
        self.failures = 0

    def event(self, message: dict[str, Any]) -> bool:
        event, value = int(message["event"]), int(message["value"])
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            return True
        if not event & HANDSHAKE_EVENTS:
            return False
        self.failures += 1
        now = self._clock()
        if now - self._last_line < self.interval:
            self._suppressed += 1
            return False
        more = f" ({self._suppressed} more since the last line)" if self._suppressed else ""
        self._last_line, self._suppressed = now, 0
        if self.server:
            log.warning(
                "refused a connection to %s: %s (a peer without the cluster secret)%s",
                self.what,
                _reason(event, value),
                more,
            )
        else:
            log.error(
                "cannot authenticate to %s: %s; do both sides have the same cluster secret?%s",
                self.what,
                _reason(event, value),
                more,
            )
        return False
