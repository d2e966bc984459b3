"""The ranks as the router sees them: who is registered and healthy, the balancers that pick
among them, readiness, and their metrics. No sockets and no requests: the router
(dsinfer/gateway/router.py) feeds it the ranks' messages and asks it where to send a choice."""

from __future__ import annotations

import asyncio
import logging

from dsinfer.balancers.base import Balancer, RouteRequest
from dsinfer.balancers.factory import make_balancer
from dsinfer.base.expert_load import sum_loads
from dsinfer.base.hashing import page_hashes
from dsinfer.base.protocol import ROLES, LoadReport, Register
from dsinfer.gateway.backend import POOL_EVENTS, BackendMetrics, Capacity, WorkerStatus
from dsinfer.gateway.registry import WorkerInfo, WorkerRegistry

log = logging.getLogger("dsinfer.gateway")


class Pools:
    def __init__(self, balancer: str = "load", heartbeat_timeout: float | None = None) -> None:
        self.balancer_kind = balancer
        self.registry = WorkerRegistry() if heartbeat_timeout is None else WorkerRegistry(heartbeat_timeout)
        self.balancers: dict[str, Balancer] = {}  # made at the first registration (its page size)
        self._announced_ready = False  # last readiness logged (a line when it changes)
        self.first_ready = asyncio.Event()  # set once, the first time the pools can serve
        self.events: dict[tuple[str, str], int] = {}  # ("<role>/<pool>", event) -> count

    # The ranks' messages -----------------------------------------------------------------------
    def register(self, msg: Register, now: float) -> WorkerInfo | None:
        """Record a Register; returns the entry it replaced (the rank's previous incarnation)."""
        accepted, replaced = self.registry.register(msg, now)
        if accepted and not self.balancers:
            self.balancers = {role: make_balancer(self.balancer_kind, role, msg.page_size) for role in ROLES}
        if accepted and msg.rejoined and replaced is not None:
            self.event(msg.role, msg.pool, "rank_rejoined")
        return replaced

    def event(self, role: str, pool: int, event: str) -> None:
        """Count a pool event: ``pool_restarted`` (PoolDown), ``rank_died`` (RankDown: the pool
        shrank and serves on), ``rank_rejoined``."""
        key = (f"{role}/{pool}", event)
        self.events[key] = self.events.get(key, 0) + 1

    def report(self, msg: LoadReport, now: float) -> None:
        info = self.registry.report(msg, now)
        if info is not None:
            self.balancers[info.role].update(msg, now)

    def out_of_rotation(self, worker: str) -> None:
        """The balancers forget ``worker`` (dead, drained or unreachable)."""
        for balancer in self.balancers.values():
            balancer.remove(worker)

    def unreachable(self, worker: str) -> None:
        """A send to ``worker`` failed: out of rotation until its next heartbeat, unless its pool is down."""
        info = self.registry.get(worker)
        if info is not None and info.healthy:
            info.healthy = False
            self.out_of_rotation(worker)

    # Routing ------------------------------------------------------------------------------------
    def ready(self) -> bool:
        return self.pd_ready() or bool(self.registry.candidates("colocated"))

    def pd_ready(self) -> bool:
        candidates = self.registry.candidates
        return bool(candidates("prefill") and candidates("decode"))

    def announce_readiness(self) -> None:
        ready = self.ready()
        if ready != self._announced_ready:
            self._announced_ready = ready
            if ready:
                self.first_ready.set()
                log.info("ready: the pools can serve requests")
            else:
                log.warning("not ready: no prefill and decode rank, nor a colocated one; requests get 503")

    def route_request(
        self, request_id: str, prompt_token_ids: list[int], max_tokens: int | None
    ) -> RouteRequest:
        capacity = self.capacity()
        assert capacity is not None  # ready: a rank registered
        root = bytes.fromhex(self.registry.model or "")
        return RouteRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            page_hashes=page_hashes(prompt_token_ids, capacity.page_size, root),
            max_tokens=max_tokens or max(0, capacity.max_model_len - len(prompt_token_ids)),
        )

    def pick(self, role: str, route: RouteRequest, now: float) -> str:
        return self.balancers[role].pick(route, self.registry.candidates(role), now)

    def finished(self, request_id: str, worker: str) -> None:
        info = self.registry.get(worker)
        if info is not None:
            self.balancers[info.role].finished(request_id, worker)

    def capacity(self) -> Capacity | None:
        return self.registry.capacity()

    # Metrics ------------------------------------------------------------------------------------
    def metrics(self, queue_length: int, in_flight: int) -> BackendMetrics:
        workers, loads = [], {}
        # Every known pool's every event, at 0 until it happens: a dashboard's rate() has a series.
        events = {
            (f"{i.role}/{i.register.pool}", e): 0 for i in self.registry.workers.values() for e in POOL_EVENTS
        }
        for info in self.registry.workers.values():
            empty = LoadReport(
                worker=info.name,
                incarnation=info.register.incarnation,
                kv_pages_total=info.register.kv_pages_total,
            )
            workers.append(WorkerStatus(info.name, info.role, info.healthy, info.report or empty))
            if info.expert_load is not None:
                loads.setdefault(info.role, []).append(info.expert_load)
        return BackendMetrics(
            queue_length=queue_length,
            in_flight=in_flight,
            workers=workers,
            ready=self.ready(),
            expert_load={role: sum_loads(per_rank) for role, per_rank in loads.items()},
            pool_events=events | self.events,
        )
