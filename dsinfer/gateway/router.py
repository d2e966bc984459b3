"""The gateway's Backend over worker pools: ZMQ control socket, routing, request state.

One ROUTER socket (bound at the control address, the pools' --gateway-addr) carries every
message to and from the ranks. A job with n choices becomes n worker requests "<id>/<i>"
sharing one seed. With healthy prefill and decode ranks a choice goes PD (DecodeAdmit to the
decode rank the decode balancer picks; its KVDestination is forwarded, with the decode rank's
transfer metadata, in a PrefillRequest to the rank the prefill balancer picks); otherwise to a
colocated rank. A choice ends with its worker's last TokenDelta, an error, an abort, its
timeout, or the death of a rank it depends on; the other rank of a PD pair is then told Abort,
so every page it holds is freed (docs/serving.md has the protocol).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
import time
from collections.abc import AsyncIterator

import msgspec
import zmq
import zmq.asyncio

from dsinfer.balancers.base import Balancer, RouteRequest
from dsinfer.balancers.registry import make_balancer
from dsinfer.base.config import PAGE_SIZE
from dsinfer.base.expert_load import sum_loads
from dsinfer.base.hashing import page_hashes
from dsinfer.base.protocol import (
    Abort,
    DecodeAdmit,
    Deregister,
    GenerateRequest,
    Heartbeat,
    KVDestination,
    LoadReport,
    PoolDown,
    PrefillRequest,
    Register,
    TokenDelta,
    WorkerRequest,
    decode,
    encode,
)
from dsinfer.gateway.backend import BackendMetrics, Job, Overloaded, Unavailable, WorkerMetrics
from dsinfer.gateway.registry import WorkerInfo, WorkerRegistry

log = logging.getLogger("dsinfer.gateway")

MONITOR_INTERVAL = 0.25
RETRY_AFTER = 1.0  # seconds suggested to a client refused for overload
MAX_RETRIES = 1  # times a choice is sent again after its rank died before its first token


@dataclasses.dataclass(eq=False)
class _Choice:
    stream: RouterStream
    index: int
    seed: int
    route: RouteRequest
    deadline: float  # monotonic
    request: WorkerRequest = dataclasses.field(init=False)
    decode_worker: str = ""  # decode or colocated rank
    prefill_worker: str | None = None
    attempt: int = 0  # a choice whose rank died before its first token is sent again, once
    started: bool = False  # the first token arrived (PD: the prefill rank is done with it)
    finished: bool = False

    @property
    def workers(self) -> list[str]:
        return [w for w in (self.prefill_worker, self.decode_worker) if w is not None]

    def depends_on(self, worker: str) -> bool:
        return worker == self.decode_worker or (worker == self.prefill_worker and not self.started)


class RouterStream:
    """One job's choices as (choice, TokenDelta) pairs; ends after the last choice ended."""

    def __init__(self, router: Router, job: Job) -> None:
        self.router, self.job = router, job
        self.choices: list[_Choice] = []
        self._queue: asyncio.Queue[tuple[int, TokenDelta]] = asyncio.Queue()
        self._open = 0

    def put(self, choice: _Choice, delta: TokenDelta) -> None:
        if choice.finished:
            return
        if delta.finish_reason is not None or delta.error is not None:
            choice.finished = True
            self._open -= 1
        self._queue.put_nowait((choice.index, delta))

    async def __aiter__(self) -> AsyncIterator[tuple[int, TokenDelta]]:
        while self._open > 0 or not self._queue.empty():
            yield await self._queue.get()

    async def abort(self) -> None:
        for choice in self.choices:
            if not choice.finished:
                self.router.end_choice(
                    choice, TokenDelta(request_id=choice.request.request_id, finish_reason="abort")
                )


class Router:
    def __init__(
        self,
        control_addr: str,
        *,
        balancer: str = "load",
        max_queued_requests: int = 1024,
        default_timeout: float = 600.0,
        heartbeat_timeout: float | None = None,
    ) -> None:
        self.control_addr = control_addr
        self.max_queued_requests = max_queued_requests
        self.default_timeout = default_timeout
        self.registry = WorkerRegistry() if heartbeat_timeout is None else WorkerRegistry(heartbeat_timeout)
        self.balancers: dict[str, Balancer] = {
            role: make_balancer(balancer, role, PAGE_SIZE) for role in ("prefill", "decode", "colocated")
        }
        self._choices: dict[str, _Choice] = {}  # worker request id -> choice
        self._announced_ready = False  # last readiness logged (a line when it changes)
        self._random = random.Random()
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []

    # Lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted rank takes its name back
        self._sock.bind(f"tcp://{self.control_addr}")
        self._tasks = [asyncio.create_task(self._receive()), asyncio.create_task(self._monitor())]
        log.info("control socket listening on %s", self.control_addr)

    async def stop(self) -> None:
        for choice in list(self._choices.values()):
            self.end_choice(
                choice, TokenDelta(request_id=choice.request.request_id, error="gateway shutting down")
            )
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._sock is not None:
            self._sock.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()

    # Submission ------------------------------------------------------------------------------
    def submit(self, job: Job) -> RouterStream:
        if len(self._choices) + job.params.n > self.max_queued_requests:
            raise Overloaded(
                f"{len(self._choices)} requests in flight, the limit is {self.max_queued_requests}",
                RETRY_AFTER,
            )
        if not self._ready():
            raise Unavailable("no healthy worker: need a prefill and a decode rank, or a colocated one")
        seed = job.params.seed if job.params.seed is not None else self._random.getrandbits(63)
        deadline = time.monotonic() + (job.timeout or self.default_timeout)
        stream = RouterStream(self, job)
        stream._open = job.params.n
        route = self._route_request(job)
        for i in range(job.params.n):
            choice = _Choice(stream, i, seed, route, deadline)
            stream.choices.append(choice)
            self._dispatch(choice)
        return stream

    def _dispatch(self, choice: _Choice) -> None:
        """Send the choice to a prefill + decode pair (PD) or to a colocated rank."""
        job = choice.stream.job
        suffix = f"~{choice.attempt}" if choice.attempt else ""
        fields = dict(
            request_id=f"{job.request_id}/{choice.index}{suffix}",
            prompt_token_ids=job.prompt_token_ids,
            params=dataclasses.replace(job.params, n=1, seed=choice.seed),
            choice=choice.index,
            seed=choice.seed,
        )
        if self.registry.candidates("prefill") and self.registry.candidates("decode"):
            choice.decode_worker = self._pick("decode", choice.route)
            choice.prefill_worker = self._pick("prefill", choice.route)
            prefill = self.registry.get(choice.prefill_worker)
            assert prefill is not None
            choice.request = DecodeAdmit(
                **fields, prefill_worker=choice.prefill_worker, prefill_inbox=prefill.register.inbox
            )
        else:
            choice.decode_worker, choice.prefill_worker = self._pick("colocated", choice.route), None
            choice.request = GenerateRequest(**fields)
        self._choices[choice.request.request_id] = choice
        self._send(choice.decode_worker, choice.request)

    def _route_request(self, job: Job) -> RouteRequest:
        root = bytes.fromhex(self.registry.model or "")
        return RouteRequest(
            request_id=job.request_id,
            prompt_token_ids=job.prompt_token_ids,
            page_hashes=page_hashes(job.prompt_token_ids, PAGE_SIZE, root),
            max_tokens=job.params.max_tokens or max(0, self._max_model_len() - len(job.prompt_token_ids)),
        )

    def _max_model_len(self) -> int:
        return min((w.register.max_model_len for w in self.registry.workers.values()), default=0)

    def _pick(self, role: str, route: RouteRequest) -> str:
        return self.balancers[role].pick(route, self.registry.candidates(role), time.monotonic())

    # Ending ----------------------------------------------------------------------------------
    def end_choice(self, choice: _Choice, delta: TokenDelta) -> None:
        """Deliver the choice's last delta and tell its ranks to drop it."""
        if choice.finished:
            return
        self._forget(choice)
        for worker in choice.workers:
            self._send(worker, Abort(request_id=choice.request.request_id))
        choice.stream.put(choice, delta)

    def _forget(self, choice: _Choice) -> None:
        self._choices.pop(choice.request.request_id, None)
        for role, worker in (("prefill", choice.prefill_worker), ("decode", choice.decode_worker)):
            if worker is not None:
                info = self.registry.get(worker)
                self.balancers[info.role if info else role].finished(choice.request.request_id, worker)

    # Incoming --------------------------------------------------------------------------------
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

    def _on_message(self, message: object) -> None:
        now = time.monotonic()
        if isinstance(message, TokenDelta):
            self._on_delta(message)
        elif isinstance(message, LoadReport):
            info = self.registry.report(message, now)
            if info is not None:
                self.balancers[info.role].update(message, now)
        elif isinstance(message, KVDestination):
            self._on_destination(message)
        elif isinstance(message, Register):
            _, replaced = self.registry.register(message, now)
            if replaced is not None:
                self._fail_worker(replaced, f"worker {replaced.name} restarted")
        elif isinstance(message, Heartbeat):
            self.registry.heartbeat(message.worker, message.incarnation, now)
        elif isinstance(message, Deregister):
            info = self.registry.deregister(message.worker, message.incarnation)
            if info is not None:
                self._fail_worker(info, f"worker {info.name} stopped")
        elif isinstance(message, PoolDown):
            log.warning("pool %s/%d down: %s", message.role, message.pool, message.reason)
            for info in self.registry.pool_down(message.role, message.pool, message.incarnation):
                self._fail_worker(info, f"{message.role} pool {message.pool} went down ({message.reason})")
        if isinstance(message, Register | Deregister | PoolDown):
            self._announce_readiness()

    def _announce_readiness(self) -> None:
        ready = self._ready()
        if ready != self._announced_ready:
            self._announced_ready = ready
            if ready:
                log.info("ready: the pools can serve requests")
            else:
                log.warning("not ready: no prefill and decode rank, nor a colocated one; requests get 503")

    def _on_delta(self, delta: TokenDelta) -> None:
        choice = self._choices.get(delta.request_id)
        if choice is None:
            return
        if delta.retryable and not choice.started and choice.attempt < MAX_RETRIES and self._ready():
            self._retry(choice, delta.error or "refused")
            return
        if delta.error is not None or delta.finish_reason is not None:
            self._forget(choice)
            if delta.error is not None:
                for worker in choice.workers:
                    self._send(worker, Abort(request_id=delta.request_id))
        choice.started = True
        choice.stream.put(choice, delta)

    def _on_destination(self, dest: KVDestination) -> None:
        choice = self._choices.get(dest.request_id)
        if choice is None or choice.prefill_worker is None:
            return
        decode_info = self.registry.get(dest.worker)
        if decode_info is None:
            return
        request = choice.request
        self._send(
            choice.prefill_worker,
            PrefillRequest(
                request_id=request.request_id,
                prompt_token_ids=request.prompt_token_ids,
                params=request.params,
                choice=request.choice,
                seed=request.seed,
                destination=dest,
                decode_inbox=decode_info.register.inbox,
                decode_agent=decode_info.register.transfer_agent,
                decode_transfer_metadata=decode_info.register.transfer_metadata,
            ),
        )

    # Health and deadlines --------------------------------------------------------------------
    async def _monitor(self) -> None:
        while True:
            await asyncio.sleep(MONITOR_INTERVAL)
            now = time.monotonic()
            for info in self.registry.expired(now):
                self._fail_worker(info, f"worker {info.name} stopped answering")
            for choice in [c for c in self._choices.values() if now >= c.deadline]:
                self.end_choice(
                    choice, TokenDelta(request_id=choice.request.request_id, error="request timed out")
                )

    def _fail_worker(self, info: WorkerInfo, reason: str) -> None:
        """Choices that need the dead rank start again elsewhere if nothing was streamed yet
        (once), else end with ``reason``; the other rank of a PD pair is told to drop them."""
        for balancer in self.balancers.values():
            balancer.remove(info.name)
        for choice in [c for c in self._choices.values() if c.depends_on(info.name)]:
            old_id = choice.request.request_id
            if choice.started or choice.attempt >= MAX_RETRIES or not self._ready():
                self.end_choice(choice, TokenDelta(request_id=old_id, error=reason))
                continue
            self._retry(choice, reason, skip=info.name)

    def _retry(self, choice: _Choice, reason: str, skip: str | None = None) -> None:
        """Send a choice that has streamed nothing yet to other ranks; the old ones drop it."""
        old_id = choice.request.request_id
        self._forget(choice)
        for worker in choice.workers:
            if worker != skip:
                self._send(worker, Abort(request_id=old_id))
        choice.attempt += 1
        log.info("%s: %s; sending it again", old_id, reason)
        self._dispatch(choice)

    def _send(self, worker: str, message: msgspec.Struct) -> None:
        assert self._sock is not None
        sent = self._sock.send_multipart([worker.encode(), encode(message)], flags=zmq.NOBLOCK)
        # zmq.asyncio reports a failed send on the returned future, not by raising
        sent.add_done_callback(lambda f: self._sent(f, worker, message))

    def _sent(self, future: asyncio.Future[object], worker: str, message: msgspec.Struct) -> None:
        error = None if future.cancelled() else future.exception()
        if error is None:
            return
        log.warning("cannot reach %s (%s); %s not delivered", worker, error, type(message).__name__)
        info = self.registry.get(worker)
        if info is not None and info.healthy:
            info.healthy = False  # back in rotation with its next heartbeat, unless its pool is down
            for balancer in self.balancers.values():
                balancer.remove(worker)
        choice = self._choices.get(getattr(message, "request_id", ""))
        if choice is None or isinstance(message, Abort):
            return
        reason = f"worker {worker} unreachable"
        if choice.started or choice.attempt >= MAX_RETRIES or not self._ready():
            self.end_choice(choice, TokenDelta(request_id=choice.request.request_id, error=reason))
        else:
            self._retry(choice, reason, skip=worker)

    # Metrics ---------------------------------------------------------------------------------
    def metrics_snapshot(self) -> BackendMetrics:
        workers = []
        for info in self.registry.workers.values():
            r = info.report or LoadReport(worker=info.name, incarnation=info.register.incarnation)
            workers.append(
                WorkerMetrics(
                    worker=info.name,
                    role=info.role,
                    healthy=info.healthy,
                    num_running=r.num_running,
                    num_waiting=r.num_waiting,
                    kv_pages_used=r.kv_pages_used,
                    kv_pages_total=r.kv_pages_total or info.register.kv_pages_total,
                    prompt_tokens=r.prompt_tokens,
                    memory_hit_tokens=r.memory_hit_tokens,
                    disk_hit_tokens=r.disk_hit_tokens,
                    transfer_bytes=r.transfer_bytes,
                    transfer_seconds=r.transfer_seconds,
                    transfers=r.transfers,
                )
            )
        waiting = sum(1 for c in self._choices.values() if not c.started)
        loads: dict[str, list[dict[int, list[int]]]] = {}
        for info in self.registry.workers.values():
            if info.expert_load is not None:
                loads.setdefault(info.role, []).append(info.expert_load)
        return BackendMetrics(
            queue_length=waiting,
            in_flight=len(self._choices),
            workers=workers,
            ready=self._ready(),
            expert_load={role: sum_loads(per_rank) for role, per_rank in loads.items()},
        )

    def _ready(self) -> bool:
        candidates = self.registry.candidates
        return bool(candidates("prefill") and candidates("decode")) or bool(candidates("colocated"))
