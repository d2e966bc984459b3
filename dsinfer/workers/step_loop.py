"""A rank's loop, in lockstep with its pool (docs/architecture.md, "The per-step agreement").

Every iteration the rank registers (again) when a gateway is new, takes its messages (an idle rank
that just got requests takes the rest of their burst first), lets its role handle them and tick,
plans its step, and agrees with the pool in one all-reduce of the votes (work, busy, stopping,
and the engine's micro-batch and EPLB votes); every rank steps when any rank has work, an empty
batch where it has none, so the collectives of a step always line up. When the whole pool is
idle each rank blocks in its socket poll for up to ``IDLE_POLL_MS`` instead of spinning.
``stop()`` (SIGTERM) drains: the rank refuses new requests, finishes what it holds, and the pool
leaves the loop together once every rank is stopping and no rank is busy.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from dsinfer.base.protocol import (
    EXPERT_LOAD_INTERVAL,
    HEARTBEAT_INTERVAL,
    REGISTER_EVERY,
    Register,
    WorkerRequest,
)
from dsinfer.connector.messages import AnyMessage
from dsinfer.engine.facade import EngineFacade
from dsinfer.transfer.base import TransferBackend
from dsinfer.workers.channel import WorkerChannel
from dsinfer.workers.elastic import ElasticPool
from dsinfer.workers.role import RoleWorker

log = logging.getLogger("dsinfer.worker")

IDLE_POLL_MS = 20
BUSY_POLL_MS = 1  # waiting on transfers or timers only: come back soon without spinning
BURST_GAP_MS = 5  # an idle rank's new requests: the burst has ended after this long without one
BURST_WINDOW_MS = 50  # at most this long spent gathering a burst


def burst_continues(messages: list[AnyMessage]) -> bool:
    """Whether the newest request among ``messages`` says the gateway had more in hand."""
    requests = [m for m in messages if isinstance(m, WorkerRequest)]
    return bool(requests) and requests[-1].more_coming


def rest_of_burst(channel: WorkerChannel) -> list[AnyMessage]:
    """An idle rank whose new requests say more are coming (``WorkerRequest.more_coming``) takes
    the rest of their burst before its first step: messages until a request says it is the last,
    or the inbox stays quiet for ``BURST_GAP_MS`` (at most ``BURST_WINDOW_MS`` in all). A burst of
    clients then starts in one prefill, and the gateway, which shares the cores, hands it over
    before the forward takes them; a lone request starts at once."""
    messages: list[AnyMessage] = []
    deadline = time.monotonic() + BURST_WINDOW_MS / 1000
    while time.monotonic() < deadline and (more := channel.receive(BURST_GAP_MS)):
        messages += more
        if any(isinstance(m, WorkerRequest) for m in more) and not burst_continues(more):
            break
    return messages


class StepLoop:
    def __init__(
        self,
        engine: EngineFacade,
        role: RoleWorker,
        channel: WorkerChannel,
        register: Register,
        transfer: TransferBackend | None,
        elastic: ElasticPool | None,
    ) -> None:
        self.engine, self.role, self.channel, self.register = engine, role, channel, register
        self.transfer, self.elastic = transfer, elastic
        self.stopping = False
        self._last_report = self._last_register = self._last_expert_load = 0.0
        self._pool_working = False

    def stop(self) -> None:
        """Drain and leave (a signal handler may call it)."""
        self.stopping = True

    def run(self) -> None:
        """Until the pool agrees to stop (every rank stopping, none busy)."""
        while self._iteration():
            pass

    def _iteration(self) -> bool:
        role, channel, engine = self.role, self.channel, self.engine
        self._register_if_due(time.monotonic())
        self._take_messages()
        if self.stopping and not role.draining:
            role.draining = True
            channel.send_gateway(role.load_report())  # out of rotation before anything else
            log.info("rank %s draining", self.register.worker)
        if self.transfer is not None:
            self.transfer.progress()
        role.tick(time.monotonic())
        plan = engine.plan_step()
        votes = dataclasses.replace(
            plan.votes,
            busy=role.busy(),
            not_stopping=not self.stopping,
            pool_generation=self.elastic.vote(time.monotonic()) if self.elastic is not None else 0,
        )
        try:
            agreed = engine.agree(votes)  # the pool's one collective outside the forward
            self._pool_working = agreed.has_work
            if agreed.stopping:
                return False
            if self.elastic is not None and self.elastic.on_agreed(agreed, engine):
                return True  # re-formed: the step planned for the old group is planned again
            if agreed.has_work:
                started = time.monotonic()
                role.step(plan, agreed)
                role.step_times.observe("step", time.monotonic() - started)
        except RuntimeError as error:  # a peer died in a collective (gloo), or hung past --ep-timeout
            if self.elastic is None:
                raise
            role.step_interrupted()
            self.elastic.recover(engine, error)
            return True
        finally:
            channel.flush()  # this iteration's token deltas, one message
        self._report_if_due()
        return True

    def _register_if_due(self, now: float) -> None:
        if self.channel.gateway_connected() or now - self._last_register >= REGISTER_EVERY:
            self.channel.send_gateway(self.register)
            self._last_register = now

    def _take_messages(self) -> None:
        role = self.role
        # while the pool works, nobody makes the others wait in the next all-reduce
        working = role.has_work() or self._pool_working
        timeout = 0 if working else BUSY_POLL_MS if role.busy() else IDLE_POLL_MS
        messages = self.channel.receive(timeout)
        if timeout == IDLE_POLL_MS and burst_continues(messages):
            messages += rest_of_burst(self.channel)  # not when only transfers or timers were pending
        for message in messages:
            role.handle(message, time.monotonic())

    def _report_if_due(self) -> None:
        if time.monotonic() - self._last_report < HEARTBEAT_INTERVAL:
            return
        with_load = time.monotonic() - self._last_expert_load >= EXPERT_LOAD_INTERVAL
        self.channel.send_gateway(self.role.load_report(with_expert_load=with_load))
        self._last_report = time.monotonic()
        if with_load:
            self._last_expert_load = self._last_report
