"""The gateway's view of the worker ranks: who registered, who is healthy, their last load.

The first rank to register fixes what every later one must agree with: the model's identity,
the KV page size and ``max_model_len``. A rank that disagrees is refused with one log line per
incarnation (it keeps registering; nothing of it is routed to), so the gateway's validation
(``capacity``) holds for every rank a request can reach.

A rank out of rotation (silent, or its incarnation dead) stays listed, unhealthy, while it may
come back; once it was silent for ``FORGET_AFTER_TIMEOUTS`` heartbeat timeouts it is forgotten
(gone from /metrics too): a pool that gave up restarting, a rank an elastic pool left behind, or a
host taken away. Coming back later, it registers afresh.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from dsinfer.base.protocol import HEARTBEAT_TIMEOUT, LoadReport, Register
from dsinfer.gateway.backend import Capacity

log = logging.getLogger("dsinfer.gateway")

FORGET_AFTER_TIMEOUTS = 12  # a rank out of rotation and silent this many heartbeat timeouts is forgotten


@dataclass
class WorkerInfo:
    register: Register
    last_seen: float
    report: LoadReport | None = None
    healthy: bool = True  # heartbeats recent and its pool not reported down
    pool_down: bool = False  # this incarnation died (its pool, or the rank alone): never healthy again
    expert_load: dict[int, list[int]] | None = None  # the latest one reported

    name: str = field(init=False)  # the rest: the Register's identity, for short
    role: str = field(init=False)
    pool_key: tuple[str, int] = field(init=False)

    def __post_init__(self) -> None:
        self.name, self.role = self.register.worker, self.register.role
        self.pool_key = (self.register.role, self.register.pool)


class WorkerRegistry:
    def __init__(self, heartbeat_timeout: float = HEARTBEAT_TIMEOUT) -> None:
        self.heartbeat_timeout = heartbeat_timeout
        self.workers: dict[str, WorkerInfo] = {}
        self.reference: Register | None = None  # the first accepted Register: model and limits
        self._refused: set[tuple[str, str]] = set()  # (worker, incarnation) refused and logged

    @property
    def model(self) -> str | None:
        """Identity of the served model (None until a rank registered)."""
        return self.reference.model if self.reference is not None else None

    def register(self, msg: Register, now: float) -> tuple[bool, WorkerInfo | None]:
        """Returns (accepted, the replaced entry when the rank came back as a new incarnation)."""
        if self.reference is None:
            self.reference = msg
        disagreement = _disagreement(msg, self.reference)
        if disagreement is not None:
            if (msg.worker, msg.incarnation) not in self._refused:
                self._refused.add((msg.worker, msg.incarnation))
                log.error("refused %s: %s", msg.worker, disagreement)
            return False, None
        old = self.workers.get(msg.worker)
        if old is not None and old.register.incarnation == msg.incarnation:
            self._seen(old, now)
            return True, None
        self.workers[msg.worker] = WorkerInfo(msg, now)
        log.info(
            "worker %s registered (pool %s/%d, incarnation %s)",
            msg.worker,
            msg.role,
            msg.pool,
            msg.incarnation,
        )
        return True, old

    def report(self, msg: LoadReport, now: float) -> WorkerInfo | None:
        info = self.workers.get(msg.worker)
        if info is None or info.register.incarnation != msg.incarnation:
            return None
        info.report = msg
        if msg.expert_load is not None:
            info.expert_load = msg.expert_load
        self._seen(info, now)
        return info

    def _seen(self, info: WorkerInfo, now: float) -> None:
        info.last_seen = now
        if not info.healthy and not info.pool_down:
            info.healthy = True
            log.info("worker %s is back in rotation", info.name)

    def heartbeat(self, worker: str, incarnation: str, now: float) -> None:
        info = self.workers.get(worker)
        if info is not None and info.register.incarnation == incarnation:
            self._seen(info, now)

    def deregister(self, worker: str, incarnation: str) -> WorkerInfo | None:
        info = self.workers.get(worker)
        if info is None or info.register.incarnation != incarnation:
            return None
        del self.workers[worker]
        log.info("worker %s deregistered (drained)", worker)
        return info

    def expired(self, now: float) -> list[WorkerInfo]:
        """Healthy workers whose heartbeats stopped; they are marked unhealthy."""
        dead = [w for w in self.workers.values() if w.healthy and now - w.last_seen > self.heartbeat_timeout]
        for info in dead:
            info.healthy = False
            log.warning(
                "worker %s missed heartbeats for %.1f s: out of rotation", info.name, now - info.last_seen
            )
        return dead

    def forget_silent(self, now: float) -> list[WorkerInfo]:
        """Forget ranks out of rotation that have been silent for ``FORGET_AFTER_TIMEOUTS``
        heartbeat timeouts (they were failed when they went out of rotation)."""
        limit = self.heartbeat_timeout * FORGET_AFTER_TIMEOUTS
        gone = [w for w in self.workers.values() if not w.healthy and now - w.last_seen > limit]
        for info in gone:
            del self.workers[info.name]
            log.info(
                "forgot worker %s: out of rotation and silent for %.0f s", info.name, now - info.last_seen
            )
        return gone

    def pool_down(self, role: str, pool: int, incarnation: str) -> list[WorkerInfo]:
        down = [
            w
            for w in self.workers.values()
            if w.pool_key == (role, pool) and w.register.incarnation == incarnation and not w.pool_down
        ]
        for info in down:
            info.healthy, info.pool_down = False, True
        return down

    def rank_down(self, worker: str, incarnation: str) -> WorkerInfo | None:
        """One rank of a pool died (the survivors serve on): that incarnation never serves again."""
        info = self.workers.get(worker)
        if info is None or info.register.incarnation != incarnation or info.pool_down:
            return None
        info.healthy, info.pool_down = False, True
        return info

    def live(self, role: str) -> list[str]:
        """Ranks of ``role`` whose incarnation is not known dead (healthy or not)."""
        return sorted(w.name for w in self.workers.values() if w.role == role and not w.pool_down)

    def candidates(self, role: str) -> list[str]:
        return sorted(
            w.name
            for w in self.workers.values()
            if w.role == role and w.healthy and not (w.report is not None and w.report.draining)
        )

    def get(self, name: str) -> WorkerInfo | None:
        return self.workers.get(name)

    def capacity(self) -> Capacity | None:
        """What the registered ranks can hold (None before the first registration)."""
        if self.reference is None:
            return None
        kv_pages: dict[str, int] = {}
        for info in self.workers.values():
            if not info.pool_down:
                kv_pages[info.role] = max(kv_pages.get(info.role, 0), info.register.kv_pages_total)
        return Capacity(self.reference.max_model_len, self.reference.page_size, kv_pages)


def _disagreement(msg: Register, reference: Register) -> str | None:
    """Why ``msg`` cannot serve beside the ranks registered like ``reference``, or None."""
    if msg.model != reference.model:
        return f"it serves another model ({msg.model[:12]}, not {reference.model[:12]})"
    for name in ("max_model_len", "page_size"):
        mine, theirs = getattr(msg, name), getattr(reference, name)
        if mine != theirs:
            return f"its {name} is {mine}, the registered pools' is {theirs}"
    return None
