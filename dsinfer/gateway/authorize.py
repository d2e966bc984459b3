"""Who may tell the gateway what: a message is accepted only from the sender it speaks for.

Every peer on the control socket passed the CURVE handshake with the cluster's keys; within the
cluster, a rank speaks only for itself (its worker name is its ZMQ identity; its heartbeat
thread's is ``heartbeat_identity``), and a pool's state changes come only from that pool:
``PoolDown`` from its launcher or its registered ranks, ``RankDown`` (one rank of an elastic pool
died) from its launcher, each naming the registered incarnation (the registry ignores any
other). So a stale process, a misconfigured pool or a bug cannot take another pool out of
rotation, deregister it or speak for its ranks. Token deltas and KV destinations are checked by
the router against the ranks their choice was sent to.
"""

from __future__ import annotations

import logging

from dsinfer.base import protocol
from dsinfer.connector.messages import AnyMessage, KVDestination
from dsinfer.gateway.registry import WorkerRegistry

log = logging.getLogger("dsinfer.gateway")

MAX_LOGGED = 4096  # (sender, message kind) pairs remembered so that each is logged once


def refusal(sender: str, message: AnyMessage, registry: WorkerRegistry) -> str | None:
    """Why ``sender`` may not send ``message``, or None when it may."""
    if isinstance(message, protocol.Register):
        if sender != message.worker:
            return f"it registers {message.worker!r}"
        if not message.worker.startswith(f"{message.role}/{message.pool}/"):
            return f"its name does not match role {message.role!r} and pool {message.pool}"
        return None
    if isinstance(message, protocol.LoadReport | protocol.Deregister | KVDestination):
        return None if sender == message.worker else f"it speaks for {message.worker!r}"
    if isinstance(message, protocol.Heartbeat):
        return (
            None
            if sender == protocol.heartbeat_identity(message.worker)
            else f"it beats for {message.worker!r}"
        )
    if isinstance(message, protocol.PoolDown):
        pool = (message.role, message.pool)
        info = registry.get(sender)
        if protocol.launcher_of(sender) == pool or (info is not None and info.pool_key == pool):
            return None
        return f"it is no launcher or rank of {message.role} pool {message.pool}"
    if isinstance(message, protocol.RankDown):
        role, pool, _ = message.worker.split("/")
        if protocol.launcher_of(sender) == (role, int(pool)):
            return None
        return f"it is no launcher of {message.worker}'s pool"
    if isinstance(message, protocol.TokenDelta | protocol.TokenDeltas):
        return None  # the router checks each choice's ranks
    return "ranks do not send it to the gateway"


class RefusalLog:
    """One warning per (sender, message kind); bounded memory."""

    def __init__(self) -> None:
        self._seen: set[tuple[str, str]] = set()

    def refused(self, sender: str, message: AnyMessage, reason: str) -> None:
        key = (sender, type(message).__name__)
        if key in self._seen:
            return
        if len(self._seen) >= MAX_LOGGED:
            self._seen.clear()
        self._seen.add(key)
        log.warning("ignored %s from %r: %s", key[1], sender, reason)
