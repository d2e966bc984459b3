"""The gateway's Backend over worker pools: dispatch, PD pairing, retries, ending choices.

A job with n choices becomes n worker requests (ids by dsinfer.base.request_id: request, choice,
attempt; the choice part is the request's choice number, see backend.ChoiceRecord; the request part is the client request's id and this gateway's ``instance`` tag, so
that replicas behind one load balancer never send a rank the same id) sharing one seed, with no
stop strings (the gateway owns them). With healthy prefill and decode ranks a choice goes PD
(DecodeAdmit to the decode rank the decode balancer picks; its KVDestination is forwarded, with
the decode rank's transfer metadata, in a PrefillRequest to the rank the prefill balancer
picks); otherwise to a colocated rank. A choice ends with its
worker's last TokenDelta, an error, an abort, or the death of a rank it depends on; the other
rank of a PD pair is then told Abort, so every page it holds is freed (docs/serving.md has the
protocol).

Migration: a choice whose rank dies, stops answering or refuses it (draining) is dispatched
again, as its next attempt (``_retry_or_end``, the one place a choice moves between ranks), at
most ``max_migrations`` times; while no pool is ready (the only one restarting) it is parked and
goes out when one is, or ends at the request's deadline. The router keeps the token ids each
choice holds (its ChoiceRecord, the HTTP layer's one record of it); a choice that already streamed moves as a continuation
(``WorkerRequest.output_token_ids``): the new ranks prefill the prompt and those tokens, and the
counter-based sampler, keyed by the output position, goes on with the tokens the undisturbed
choice would have had. Tokens of the old
attempt that arrive late carry its old id and are dropped, so the stream has no duplicate and
no gap. Stop strings stay the gateway's (the HTTP layer's choice state runs on).

The sockets are dsinfer/gateway/control.py's; the ranks' registry, health, balancers and
metrics are dsinfer/gateway/pools.py's; which sender may send what, dsinfer/gateway/authorize.py.
A rank's token delta for a request this gateway does not know (it restarted, or the request
ended here already) is answered with Abort, so the rank frees what it holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
import secrets
import time

import msgspec

from dsinfer.balancers.base import RouteRequest
from dsinfer.base.cluster_secret import ControlKeys
from dsinfer.base.protocol import (
    REGISTER_EVERY,
    Abort,
    Deregister,
    GenerateRequest,
    Heartbeat,
    LoadReport,
    PoolDown,
    RankDown,
    Register,
    TokenDelta,
    TokenDeltas,
    WorkerRequest,
)
from dsinfer.base.request_id import RequestKey, format_request_id, parse_request_id
from dsinfer.base.sampling_params import SamplingParams
from dsinfer.base.tracing import NO_SPAN, OpenSpan, Tracer
from dsinfer.connector import pairing
from dsinfer.connector.messages import AnyMessage, DecodeAdmit, KVDestination
from dsinfer.gateway.authorize import RefusalLog, refusal
from dsinfer.gateway.backend import (
    BackendMetrics,
    Capacity,
    ChoiceRecord,
    DeltaSink,
    Job,
    MigrationStats,
    Unavailable,
)
from dsinfer.gateway.control import ControlSocket
from dsinfer.gateway.pools import Pools
from dsinfer.gateway.registry import WorkerInfo

log = logging.getLogger("dsinfer.gateway")

MONITOR_INTERVAL = 0.25
MAX_MIGRATIONS = 3  # times one choice may move to another rank (--max-migrations)
MAX_ORPHANS = 4096  # unknown request ids answered with Abort, remembered to answer each once
# every live rank registers within REGISTER_EVERY s of the control socket listening (at once on
# its handshake); a request to a gateway that has not been ready yet waits this long for them
FIRST_REGISTRATION_WAIT = REGISTER_EVERY + 1.0


@dataclasses.dataclass(eq=False)
class _Choice:
    """Where a choice runs: its current attempt and ranks (its tokens are its ``record``'s)."""

    stream: RouterJob
    record: ChoiceRecord
    key: RequestKey  # its current attempt's id
    request: WorkerRequest = dataclasses.field(init=False)  # its current attempt
    decode_worker: str = ""  # decode or colocated rank
    prefill_worker: str | None = None
    started: bool = False  # the current attempt's first token arrived (PD: the prefill rank is done)
    moved_at: float | None = None  # when the current attempt was dispatched as a migration
    span: OpenSpan = NO_SPAN  # the current attempt's (its ranks' spans are its children)

    @property
    def workers(self) -> list[str]:
        return [w for w in (self.prefill_worker, self.decode_worker) if w]  # none while parked

    def depends_on(self, worker: str) -> bool:
        return worker == self.decode_worker or (worker == self.prefill_worker and not self.started)


class RouterJob:
    """One job's choices: the router hands each running choice's (number, TokenDelta) pairs to the
    HTTP layer's sink, its final delta last (the router forgets a choice before delivering that)."""

    def __init__(
        self, router: Router, job: Job, sink: DeltaSink, params: SamplingParams, route: RouteRequest
    ) -> None:
        self.router, self.job, self.sink = router, job, sink
        self.params, self.route = params, route  # what every choice's worker request carries
        self.choices: list[_Choice] = []

    def put(self, choice: _Choice, delta: TokenDelta) -> None:
        self.sink(choice.record.number, delta)

    async def abort(self, choice: int | None = None) -> None:
        for c in self.choices:
            if choice in (None, c.record.number):
                self.router.end_choice(c, TokenDelta(request_id=c.request.request_id, finish_reason="abort"))


class Router:
    def __init__(
        self,
        control_addr: str,
        keys: ControlKeys,
        *,
        balancer: str = "load",
        heartbeat_timeout: float | None = None,
        max_migrations: int = MAX_MIGRATIONS,
        tracer: Tracer | None = None,
        first_registration_wait: float = FIRST_REGISTRATION_WAIT,
    ):
        self.tracer = tracer or Tracer("dsinfer-gateway", None)
        self.pools = Pools(balancer, heartbeat_timeout)
        self.control = ControlSocket(control_addr, keys, self._on_message, self._undeliverable)
        self.max_migrations = max_migrations
        self.migrations = MigrationStats()
        self._choices: dict[str, _Choice] = {}  # worker request id -> choice
        self._parked: dict[_Choice, str] = {}  # moved while no pool was ready -> why it moved
        self._refusals = RefusalLog()
        self._orphans: set[str] = set()  # unknown request ids already answered with Abort
        self.instance = secrets.token_hex(4)  # in every worker request id this gateway sends
        self._random = random.Random()
        self._monitor_task: asyncio.Task[None] | None = None
        self.first_registration_wait = first_registration_wait
        self._listening_since: float | None = None

    # Lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        await self.control.start()
        self._listening_since = time.monotonic()
        self._monitor_task = asyncio.create_task(self._monitor())

    def end_all(self, reason: str) -> None:
        """End every running choice with ``reason`` as its error (its ranks are told Abort)."""
        for choice in [*self._choices.values(), *self._parked]:
            self.end_choice(choice, TokenDelta(request_id=choice.request.request_id, error=reason))

    async def stop(self) -> None:
        self.end_all("gateway shutting down")
        if self._monitor_task is not None:
            self._monitor_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._monitor_task
        await self.control.stop()

    # Submission ------------------------------------------------------------------------------
    async def until_ready(self, deadline: float) -> bool:
        """Whether the pools can serve, awaited until ``deadline`` only while this gateway has
        never been ready and its ranks may still be registering (``first_registration_wait`` s
        after its control socket listens: a restarted gateway's ranks come back at once). Once it
        has served, a pool restarting is answered at once (the client retries the 503)."""
        if self.pools.ready():
            return True
        if self.pools.first_ready.is_set() or self._listening_since is None:
            return False
        timeout = min(deadline, self._listening_since + self.first_registration_wait) - time.monotonic()
        if timeout > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.pools.first_ready.wait(), timeout)
        return self.pools.ready()

    def submit(self, job: Job, sink: DeltaSink) -> RouterJob:
        if not self.pools.ready():
            raise Unavailable("no healthy worker: need a prefill and a decode rank, or a colocated one")
        seed = job.params.seed if job.params.seed is not None else self._random.getrandbits(63)
        params = dataclasses.replace(job.params, n=1, seed=seed, stop=[])  # the gateway owns stop strings
        route = self.pools.route_request(job.request_id, job.prompt_token_ids, job.params.max_tokens)
        stream = RouterJob(self, job, sink, params, route)
        for i, record in enumerate(job.choices):
            choice = _Choice(stream, record, RequestKey(f"{job.request_id}@{self.instance}", record.number))
            stream.choices.append(choice)
            self._dispatch(choice, more_coming=job.more_coming or i < len(job.choices) - 1)
        return stream

    def _dispatch(self, choice: _Choice, cause: str = "", more_coming: bool = False) -> None:
        """Send the choice's current attempt to a prefill + decode pair (PD) or a colocated rank
        (``cause``: why the choice moved, for a migration; ``more_coming``: WorkerRequest's)."""
        stream = choice.stream
        params = stream.params
        delivered = choice.record.token_ids
        if delivered:  # a continuation: the prompt's logprobs came with the first attempt
            params = dataclasses.replace(params, prompt_logprobs=None)
        choice.span = self.tracer.open(
            "attempt",
            stream.job.traceparent,
            {"dsinfer.choice": choice.record.number, "dsinfer.attempt": choice.key.attempt},
        )
        fields = dict(
            traceparent=choice.span.traceparent,
            request_id=format_request_id(choice.key),
            prompt_token_ids=stream.job.prompt_token_ids,
            params=params,
            choice=choice.record.number % stream.job.params.n,  # the sampler's key
            output_token_ids=list(delivered),
            more_coming=more_coming,
        )
        now = time.monotonic()
        # the balancers count the choice under its worker request id, the one ``_forget`` reports
        route = dataclasses.replace(stream.route, request_id=fields["request_id"])
        if self.pools.pd_ready():
            choice.decode_worker = self.pools.pick("decode", route, now)
            choice.prefill_worker = self.pools.pick("prefill", route, now)
            prefill = self.pools.registry.get(choice.prefill_worker)
            assert prefill is not None
            choice.request = pairing.decode_admit(GenerateRequest(**fields), prefill.register)
        else:
            choice.decode_worker, choice.prefill_worker = self.pools.pick("colocated", route, now), None
            choice.request = GenerateRequest(**fields)
        choice.span.set({"dsinfer.decode_worker": choice.decode_worker, "dsinfer.migration_cause": cause})
        if choice.prefill_worker is not None:
            choice.span.set({"dsinfer.prefill_worker": choice.prefill_worker})
        self._choices[choice.request.request_id] = choice
        self.control.send(choice.decode_worker, choice.request)

    # Ending ----------------------------------------------------------------------------------
    def end_choice(self, choice: _Choice, delta: TokenDelta) -> None:
        """Deliver the choice's last delta and tell its ranks to drop it (nothing if it ended already)."""
        if not self._running(choice):
            return
        self._parked.pop(choice, None)
        self._forget(choice)
        for worker in choice.workers:
            self.control.send(worker, Abort(request_id=choice.request.request_id))
        choice.span.end(delta.error)
        choice.stream.put(choice, delta)

    def _running(self, choice: _Choice) -> bool:
        return self._choices.get(choice.request.request_id) is choice or choice in self._parked

    def _forget(self, choice: _Choice) -> None:
        self._choices.pop(choice.request.request_id, None)
        for worker in choice.workers:
            self.pools.finished(choice.request.request_id, worker)

    def _fail_worker(self, info: WorkerInfo, reason: str, cause: str, dead: bool = True) -> None:
        """Choices that need the rank move to other ranks (``_retry_or_end``); the other rank of
        a PD pair is told to drop them. ``dead``: nothing is sent to the rank any more."""
        self.pools.out_of_rotation(info.name)
        for choice in [c for c in self._choices.values() if c.depends_on(info.name)]:
            self._retry_or_end(choice, reason, cause, skip=info.name if dead else None)
        if dead and info.role == "prefill":  # after the Aborts: its transfers are fenced
            for name in self.pools.registry.live("decode"):
                self.control.send(name, pairing.peer_down(info.name))

    def _retry_or_end(self, choice: _Choice, reason: str, cause: str, skip: str | None = None) -> None:
        """Dispatch the choice again as its next attempt, a continuation of the tokens it
        delivered (the old ranks drop the old attempt), or end it with ``reason`` once it moved
        ``max_migrations`` times or past its deadline. With no pool ready it is parked until one
        is (``_dispatch_parked``) or its deadline passes (``_end_overdue_parked``)."""
        old_id = choice.request.request_id
        late = time.monotonic() >= choice.stream.job.deadline  # the HTTP layer times it out anyway
        if choice.key.attempt >= self.max_migrations or late:
            if choice.key.attempt >= self.max_migrations:
                reason = f"{reason}; the choice already moved {choice.key.attempt} times (--max-migrations)"
            self.end_choice(choice, TokenDelta(request_id=old_id, error=reason))
            return
        self._forget(choice)
        for worker in choice.workers:
            if worker != skip:
                self.control.send(worker, Abort(request_id=old_id))
        choice.span.event("migrated", {"dsinfer.migration_cause": cause, "dsinfer.reason": reason})
        choice.span.end(reason)
        choice.key = choice.key.next_attempt()
        choice.started, choice.moved_at = False, time.monotonic()
        self.migrations.moved(cause, streaming=bool(choice.record.token_ids))
        if not self.pools.ready():
            log.info(
                "%s: %s; attempt %d waits for a pool to serve again (until the request's deadline)",
                old_id,
                reason,
                choice.key.attempt,
            )
            choice.decode_worker, choice.prefill_worker = "", None
            self._parked[choice] = reason
            return
        log.info(
            "%s: %s; moving it as attempt %d after %d delivered tokens (%s)",
            old_id,
            reason,
            choice.key.attempt,
            len(choice.record.token_ids),
            cause,
        )
        self._dispatch(choice, cause)

    def _dispatch_parked(self) -> None:
        """Parked choices go out once a pool serves again."""
        if not self._parked or not self.pools.ready():
            return
        parked, self._parked = self._parked, {}
        for choice in parked:
            log.info("%s: dispatched again once a pool was ready", format_request_id(choice.key))
            self._dispatch(choice, "parked")

    def _end_overdue_parked(self, now: float) -> None:
        for choice, reason in list(self._parked.items()):
            if now >= choice.stream.job.deadline:
                error = f"{reason}; no pool could serve it again before the request's deadline"
                self.end_choice(choice, TokenDelta(request_id=format_request_id(choice.key), error=error))

    # Incoming --------------------------------------------------------------------------------
    def _on_message(self, sender: str, message: AnyMessage) -> None:
        now = time.monotonic()
        registry = self.pools.registry
        reason = refusal(sender, message, registry)
        if reason is not None:
            self._refusals.refused(sender, message, reason)
            return
        if isinstance(message, TokenDeltas):
            for delta in message.deltas:
                self._on_delta(sender, delta)
        elif isinstance(message, TokenDelta):
            self._on_delta(sender, message)
        elif isinstance(message, LoadReport):
            self.pools.report(message, now)
        elif isinstance(message, KVDestination):
            self._on_destination(message)
        elif isinstance(message, Register):
            replaced = self.pools.register(message, now)
            if replaced is not None:
                self._fail_worker(replaced, f"worker {replaced.name} restarted", "rank_died")
        elif isinstance(message, Heartbeat):
            registry.heartbeat(message.worker, message.incarnation, now)
        elif isinstance(message, Deregister):
            info = registry.deregister(message.worker, message.incarnation)
            if info is not None:
                self._fail_worker(info, f"worker {info.name} stopped", "drained")
        elif isinstance(message, PoolDown):
            log.warning("pool %s/%d down: %s", message.role, message.pool, message.reason)
            self.pools.event(message.role, message.pool, "pool_restarted")
            for info in registry.pool_down(message.role, message.pool, message.incarnation):
                reason = f"{message.role} pool {message.pool} went down ({message.reason})"
                self._fail_worker(info, reason, "rank_died")
        elif isinstance(message, RankDown):
            info = registry.rank_down(message.worker, message.incarnation)
            if info is not None:
                self.pools.event(info.role, info.register.pool, "rank_died")
                log.warning("worker %s died, its pool serves on: %s", message.worker, message.reason)
                self._fail_worker(info, f"worker {message.worker} died ({message.reason})", "rank_died")
        # a rank back by heartbeat or report (unresponsive, unreachable or draining before) counts too
        if isinstance(message, Register | Deregister | PoolDown | RankDown | Heartbeat | LoadReport):
            self.pools.announce_readiness()
            self._dispatch_parked()

    def _on_delta(self, sender: str, delta: TokenDelta) -> None:
        choice = self._choices.get(delta.request_id)
        if choice is None:
            self._orphan(sender, delta)
            return
        if sender not in choice.workers:
            self._refusals.refused(sender, delta, f"{delta.request_id} was not sent to it")
            return
        if delta.retryable and not choice.started:
            self._retry_or_end(choice, delta.error or "refused", "refused")
            return
        if delta.token_ids and not choice.started:
            choice.span.event("first_token")
        if delta.error is not None or delta.finish_reason is not None:
            self._forget(choice)
            if delta.error is not None:
                for worker in choice.workers:
                    self.control.send(worker, Abort(request_id=delta.request_id))
            choice.span.end(delta.error)
        choice.started = True
        if delta.token_ids and choice.moved_at is not None:
            self.migrations.resumed_after(time.monotonic() - choice.moved_at)
            choice.moved_at = None
        choice.stream.put(choice, delta)

    def _orphan(self, sender: str, delta: TokenDelta) -> None:
        """A delta of no choice here: late (the choice ended) or from before this gateway started."""
        with contextlib.suppress(ValueError):
            key = parse_request_id(delta.request_id)
            log.debug("late delta of %s choice %d attempt %d", key.request, key.choice, key.attempt)
        if delta.finish_reason is not None or delta.error is not None or delta.request_id in self._orphans:
            return
        if len(self._orphans) >= MAX_ORPHANS:
            self._orphans.clear()
        self._orphans.add(delta.request_id)
        self.control.send(sender, Abort(request_id=delta.request_id))

    def _on_destination(self, dest: KVDestination) -> None:
        choice = self._choices.get(dest.request_id)
        if choice is None or choice.prefill_worker is None or not isinstance(choice.request, DecodeAdmit):
            return
        decode_info = self.pools.registry.get(dest.worker)
        if decode_info is None or dest.worker != choice.decode_worker:
            return
        request = pairing.prefill_request(choice.request, dest, decode_info.register)
        if request is not None:
            choice.span.event("kv_destination", {"dsinfer.pages": len(dest.pages)})
            self.control.send(choice.prefill_worker, request)

    def _undeliverable(self, worker: str, message: msgspec.Struct) -> None:
        self.pools.unreachable(worker)
        choice = self._choices.get(getattr(message, "request_id", ""))
        if choice is not None and not isinstance(message, Abort):
            self._retry_or_end(choice, f"worker {worker} unreachable", "unreachable", skip=worker)

    # Health ----------------------------------------------------------------------------------
    async def _monitor(self) -> None:
        while True:
            await asyncio.sleep(MONITOR_INTERVAL)
            now = time.monotonic()
            for info in self.pools.registry.expired(now):
                self._fail_worker(info, f"worker {info.name} stopped answering", "unresponsive", dead=False)
            if self.pools.registry.forget_silent(now):
                self.pools.announce_readiness()
            self._end_overdue_parked(now)

    # Metrics ---------------------------------------------------------------------------------
    def metrics_snapshot(self) -> BackendMetrics:
        waiting = sum(1 for c in self._choices.values() if not c.started) + len(self._parked)
        metrics = self.pools.metrics(queue_length=waiting, in_flight=len(self._choices) + len(self._parked))
        metrics.migrations = self.migrations
        return metrics

    def capacity(self) -> Capacity | None:
        return self.pools.capacity()
