"""A rank's control-plane sockets: a DEALER to every gateway, a PULL inbox for peer ranks, and
one PUSH per peer inbox it writes to. Messages are protocol structs; nothing else goes through.

``--gateway-addr`` may name several gateways (``HOST:PORT,HOST:PORT``, or a DNS name with one
address per gateway replica, e.g. a headless Kubernetes Service): the rank connects one DEALER to each address,
re-resolving the name every ``RESOLVE_EVERY`` s on its heartbeat thread, so that every replica
knows every rank. Register, load reports, heartbeats and Deregister go to all of them; what
concerns one request goes back to the gateway that sent the request.

Every socket speaks CURVE with the cluster's keys (dsinfer/base/control_auth.py): the inbox is a
CURVE server behind this process's ZAP authenticator; the others are clients. A failed handshake
with a gateway is logged (a different cluster secret), a successful one is reported by
``gateway_connected`` so that the rank registers at once with a gateway that (re)started.

TokenDeltas are held per gateway until ``flush`` (the rank loop calls it once per iteration) and
go as one TokenDeltas message per gateway; any other message to a gateway flushes them first, so
a gateway sees every message in the order the rank sent it.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections import OrderedDict
from dataclasses import dataclass

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

from dsinfer.base.cluster_secret import ControlKeys
from dsinfer.base.control_auth import (
    HANDSHAKE_EVENTS,
    HandshakeLog,
    connect_curve,
    serve_curve,
    start_authenticator,
)
from dsinfer.base.protocol import (
    TokenDelta,
    TokenDeltas,
    WorkerRequest,
    encode,
    heartbeat_identity,
)
from dsinfer.connector.messages import AnyMessage, decode

log = logging.getLogger("dsinfer.worker")

SEND_HWM = 10_000  # queued outgoing messages per socket before send raises (peer gone for long)
RESOLVE_EVERY = 5.0  # seconds between two look-ups of the gateways' addresses
MAX_OWNERS = 65_536  # requests whose gateway is remembered (decode ones leave with their last delta)


def gateway_endpoints(addr: str) -> tuple[str, ...]:
    """``tcp://`` endpoints of the gateways ``addr`` names: ``HOST:PORT``, or several separated
    by commas; a HOST that resolves to several addresses (a headless Service) gives one per
    address. Sorted; empty when no name resolves now."""
    endpoints: set[str] = set()
    for one in addr.split(","):
        host, sep, port = one.strip().rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"gateway address {one.strip()!r} is not HOST:PORT")
        try:
            infos = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
        except socket.gaierror as e:
            log.warning("cannot resolve the gateway address %s: %s", one.strip(), e)
            continue
        for family, _, _, _, sockaddr in infos:
            ip = str(sockaddr[0])
            endpoints.add(f"tcp://[{ip}]:{port}" if family == socket.AF_INET6 else f"tcp://{ip}:{port}")
    return tuple(sorted(endpoints))


@dataclass
class _Gateway:
    sock: zmq.Socket[bytes]
    monitor: zmq.Socket[bytes]
    handshakes: HandshakeLog


class WorkerChannel:
    def __init__(self, worker: str, gateway_addr: str, host: str, keys: ControlKeys) -> None:
        self.worker = worker
        self._keys = keys
        self._ctx = zmq.Context()
        self._auth = start_authenticator(self._ctx, keys)
        self._gateway_addr = gateway_addr
        self._gateways: dict[str, _Gateway] = {}
        self._resolved = gateway_endpoints(gateway_addr)  # replaced by the heartbeat thread
        self._owner: OrderedDict[str, str] = OrderedDict()  # request id -> its gateway's endpoint
        self._connected = False
        self._poller = zmq.Poller()
        self._inbox = self._ctx.socket(zmq.PULL)
        self._inbox.setsockopt(zmq.LINGER, 0)
        serve_curve(self._inbox, keys.inbox)
        self._inbox_monitor = self._inbox.get_monitor_socket(HANDSHAKE_EVENTS)
        port = self._inbox.bind_to_random_port(f"tcp://{host}")
        self.inbox_addr = f"tcp://{host}:{port}"
        self._inbox_handshakes = HandshakeLog(f"the inbox of {worker} ({self.inbox_addr})", server=True)
        self._poller.register(self._inbox, zmq.POLLIN)
        self._poller.register(self._inbox_monitor, zmq.POLLIN)
        self._peers: dict[str, zmq.Socket[bytes]] = {}
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        self._deltas: dict[str, list[TokenDelta]] = {}  # gateway endpoint -> held deltas
        self._reconcile()

    # Gateways ------------------------------------------------------------------------------------
    def _reconcile(self) -> None:
        """One DEALER per resolved gateway address; a vanished address's socket is closed."""
        resolved = set(self._resolved)
        if not resolved:
            return  # keep what we have while the name does not resolve
        for endpoint in [e for e in self._gateways if e not in resolved]:
            gone = self._gateways.pop(endpoint)
            for sock in (gone.sock, gone.monitor):
                self._poller.unregister(sock)
            gone.sock.disable_monitor()
            gone.sock.close(linger=0)
            gone.monitor.close(linger=0)
            log.info("gateway %s is gone from %s", endpoint, self._gateway_addr)
        for endpoint in sorted(resolved - self._gateways.keys()):
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, self.worker.encode())
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, SEND_HWM)
            connect_curve(sock, self._keys, self._keys.gateway)
            monitor = sock.get_monitor_socket(HANDSHAKE_EVENTS)
            sock.connect(endpoint)
            self._gateways[endpoint] = _Gateway(
                sock, monitor, HandshakeLog(f"the gateway {endpoint}", server=False)
            )
            self._poller.register(sock, zmq.POLLIN)
            self._poller.register(monitor, zmq.POLLIN)
            if len(self._gateways) > 1 or len(resolved) > 1:
                log.info("connected to gateway %s (%s)", endpoint, self._gateway_addr)

    def gateway_connected(self) -> bool:
        """Whether a handshake with a gateway succeeded since the last call (register again)."""
        connected, self._connected = self._connected, False
        return connected

    def send_gateway(self, message: msgspec.Struct) -> None:
        """To the gateway that sent the request the message is about, else to every gateway.
        TokenDeltas wait for ``flush``."""
        request_id = getattr(message, "request_id", None)
        if request_id is None:
            targets = list(self._gateways)
        else:
            endpoint = self._owner.get(request_id)
            if isinstance(message, TokenDelta) and (message.finish_reason or message.error):
                self._owner.pop(request_id, None)
            if endpoint is None and len(self._gateways) == 1:
                endpoint = next(iter(self._gateways))
            if endpoint is None or endpoint not in self._gateways:
                log.debug("no gateway for %s of %s; dropped", type(message).__name__, request_id)
                return
            if isinstance(message, TokenDelta):
                self._deltas.setdefault(endpoint, []).append(message)
                return
            targets = [endpoint]
        self.flush()
        self._send(targets, message)

    def flush(self) -> None:
        """Send the held TokenDeltas, one TokenDeltas message per gateway."""
        held, self._deltas = self._deltas, {}
        for endpoint, deltas in held.items():
            self._send([endpoint], TokenDeltas(deltas=deltas))

    def _send(self, endpoints: list[str], message: msgspec.Struct) -> None:
        frame = encode(message)
        for endpoint in endpoints:
            gateway = self._gateways.get(endpoint)
            if gateway is None:
                log.debug("gateway %s is gone; dropped %s", endpoint, type(message).__name__)
                continue
            try:
                gateway.sock.send(frame, zmq.NOBLOCK)
            except zmq.Again:
                log.warning("gateway %s socket full; dropped %s", endpoint, type(message).__name__)

    # Peers ---------------------------------------------------------------------------------------
    def send_peer(self, inbox: str, message: msgspec.Struct) -> None:
        sock = self._peers.get(inbox)
        if sock is None:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, SEND_HWM)
            connect_curve(sock, self._keys, self._keys.inbox)
            sock.connect(inbox)
            self._peers[inbox] = sock
        try:
            sock.send(encode(message), zmq.NOBLOCK)
        except zmq.Again:
            log.warning("peer %s unreachable; dropped %s", inbox, type(message).__name__)

    # Receiving -----------------------------------------------------------------------------------
    def receive(self, timeout_ms: int) -> list[AnyMessage]:
        """Every message waiting (gateways first), blocking up to ``timeout_ms`` for the first."""
        if set(self._resolved) - self._gateways.keys() or self._gateways.keys() - set(self._resolved):
            self._reconcile()
        messages: list[AnyMessage] = []
        events = dict(self._poller.poll(timeout_ms))
        for endpoint, gateway in list(self._gateways.items()):
            if gateway.monitor in events:
                self._drain_monitor(gateway.monitor, gateway.handshakes, gateway=True)
            if gateway.sock in events:
                for message in self._drain(gateway.sock):
                    if isinstance(message, WorkerRequest):
                        self._own(message.request_id, endpoint)
                    messages.append(message)
        if self._inbox_monitor in events:
            self._drain_monitor(self._inbox_monitor, self._inbox_handshakes, gateway=False)
        if self._inbox in events:
            messages.extend(self._drain(self._inbox))
        return messages

    def _own(self, request_id: str, endpoint: str) -> None:
        self._owner[request_id] = endpoint
        self._owner.move_to_end(request_id)
        while len(self._owner) > MAX_OWNERS:
            self._owner.popitem(last=False)

    def _drain(self, sock: zmq.Socket[bytes]) -> list[AnyMessage]:
        messages: list[AnyMessage] = []
        while True:
            try:
                frame = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return messages
            try:
                messages.append(decode(frame))
            except (msgspec.DecodeError, ValueError) as e:
                log.error("dropped an undecodable control message: %s", e)

    def _drain_monitor(self, monitor: zmq.Socket[bytes], handshakes: HandshakeLog, *, gateway: bool) -> None:
        while True:
            try:
                frames = monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if handshakes.event(parse_monitor_message(frames)) and gateway:
                self._connected = True

    # Heartbeats ----------------------------------------------------------------------------------
    def start_heartbeat(self, message: msgspec.Struct, interval: float) -> None:
        """A daemon thread with its own sockets sends ``message`` to every gateway every
        ``interval`` seconds, and looks the gateways' addresses up every ``RESOLVE_EVERY`` s."""
        frame = encode(message)
        identity = heartbeat_identity(self.worker).encode()

        def beat() -> None:
            socks: dict[str, zmq.Socket[bytes]] = {}
            since_resolve = 0.0
            try:
                while not self._stop.wait(interval):
                    since_resolve += interval
                    if since_resolve >= RESOLVE_EVERY:
                        since_resolve = 0.0
                        resolved = gateway_endpoints(self._gateway_addr)
                        if resolved:
                            self._resolved = resolved
                    for endpoint in [e for e in socks if e not in self._resolved]:
                        socks.pop(endpoint).close(linger=0)
                    for endpoint in self._resolved:
                        sock = socks.get(endpoint)
                        if sock is None:
                            sock = socks[endpoint] = self._ctx.socket(zmq.DEALER)
                            sock.setsockopt(zmq.IDENTITY, identity)
                            sock.setsockopt(zmq.LINGER, 0)
                            connect_curve(sock, self._keys, self._keys.gateway)
                            sock.connect(endpoint)
                        with contextlib.suppress(zmq.Again):
                            sock.send(frame, zmq.NOBLOCK)
            finally:
                for sock in socks.values():
                    sock.close(linger=0)

        self._beat = threading.Thread(target=beat, name="heartbeat", daemon=True)
        self._beat.start()

    def close(self) -> None:
        self.flush()
        self._stop.set()
        if self._beat is not None:
            self._beat.join(timeout=5)
        for gateway in self._gateways.values():
            gateway.sock.disable_monitor()
            gateway.sock.close(linger=0)
            gateway.monitor.close(linger=0)
        self._inbox.disable_monitor()
        for sock in [self._inbox, self._inbox_monitor, *self._peers.values()]:
            sock.close(linger=0)
        self._auth.stop()
        self._ctx.term()
