"""What every worker role shares: the engine's façade, the outbox, token deltas and load reports.

A role is driven by the rank loop (dsinfer/workers/rank.py): ``handle`` each control message,
``tick`` for time-driven work (transfer progress, timeouts), ``step`` for one engine forward when
the pool agreed to step. A role never blocks. The PD roles (dsinfer/workers/decode.py,
prefill.py) route their messages to the KV connector's sides (dsinfer/connector).
"""

from __future__ import annotations

import dataclasses
import logging
from abc import ABC, abstractmethod
from typing import Protocol

from dsinfer.base.protocol import Abort, GenerateRequest, LoadReport, TokenDelta, WorkerRequest
from dsinfer.base.stages import RequestStages, StageHistogram
from dsinfer.base.tracing import Tracer
from dsinfer.connector.messages import AnyMessage
from dsinfer.connector.outbox import Outbox, TransferCounters
from dsinfer.engine.agreement import StepVotes
from dsinfer.engine.facade import EngineFacade
from dsinfer.engine.step import EngineLoad, SeqUpdate, StepPlan

log = logging.getLogger("dsinfer.worker")


def token_delta(update: SeqUpdate, num_cached_tokens: int | None = None) -> TokenDelta:
    """A step's update as the wire's TokenDelta; a sequence's first one carries the prompt's
    facts (``num_cached_tokens`` overrides the cached prompt tokens, e.g. the prefill rank's)."""
    delta = TokenDelta(
        request_id=update.request_id,
        token_ids=update.new_token_ids,
        logprobs=update.new_logprobs,
        finish_reason=update.finish_reason,
    )
    if update.is_first:
        delta.num_prompt_tokens = update.prompt_len
        delta.num_cached_tokens = (
            update.num_cached_prompt_tokens if num_cached_tokens is None else num_cached_tokens
        )
        if update.prompt_logprobs is not None:
            delta.prompt_logprobs = update.prompt_logprobs
    return delta


def load_report(
    worker: str,
    incarnation: str,
    load: EngineLoad,
    *,
    queued_elsewhere: int = 0,
    transfers: TransferCounters | None = None,
    stages: StageHistogram | None = None,
    steps: StageHistogram | None = None,
    draining: bool = False,
) -> LoadReport:
    """A rank's LoadReport: its engine's load, the requests its role holds outside the engine's
    queues (``queued_elsewhere``, counted as waiting) and its KV transfers."""
    transfers = transfers or TransferCounters()
    # every field of EngineLoad is a LoadReport field of its name
    engine = {field.name: getattr(load, field.name) for field in dataclasses.fields(load)}
    engine["num_waiting"] += queued_elsewhere
    return LoadReport(
        worker=worker,
        incarnation=incarnation,
        **engine,
        transfer_bytes=transfers.bytes,
        transfer_bytes_by_group=dict(transfers.bytes_by_group),
        transfer_seconds=transfers.seconds,
        transfers=transfers.count,
        stage_counts=dict(stages.counts) if stages is not None else {},
        stage_seconds=dict(stages.sums) if stages is not None else {},
        step_counts=list(steps.counts.get("step", [])) if steps is not None else [],
        step_seconds=steps.sums.get("step", 0.0) if steps is not None else 0.0,
        draining=draining,
    )


class RoleWorker(ABC):
    role: str

    def __init__(self, engine: EngineFacade, outbox: Outbox, worker: str, incarnation: str) -> None:
        self.engine, self.outbox, self.worker, self.incarnation = engine, outbox, worker, incarnation
        self.draining = False
        # its requests' stages (histograms in the load report) and spans on this rank (named after
        # the role); spans only once ``trace_with`` gave it a tracer that is on
        self.step_times = StageHistogram()  # the pool's agreed steps on this rank
        self.stages = RequestStages(
            Tracer(f"dsinfer-{self.role}", None), self.role, {"dsinfer.worker": worker}
        )

    @property
    def tracer(self) -> Tracer:
        return self.stages.tracer

    def trace_with(self, tracer: Tracer) -> None:
        self.stages.tracer = tracer

    @abstractmethod
    def handle(self, message: AnyMessage, now: float) -> None: ...

    def tick(self, now: float) -> None:  # noqa: B027 - roles without timed work need none
        """Time-driven work: transfer progress, timeouts, retries."""

    def has_work(self) -> bool:
        """Whether the engine has something to compute (the pool steps when any rank has)."""
        return self.engine.has_unfinished_requests()

    def busy(self) -> bool:
        """Whether the loop must come back soon even without messages (work or timed work)."""
        return self.has_work()

    def step(self, plan: StepPlan, agreed: StepVotes) -> None:
        """The step the pool agreed on (every rank calls it, with or without work)."""
        for update in self.engine.run_step(plan, agreed):
            self.outbox.send_gateway(token_delta(update))
            if update.finish_reason is not None:
                self.stages.end(update.request_id, finish=update.finish_reason)

    def step_interrupted(self) -> None:  # noqa: B027 - roles without per-step state need none
        """The step's collectives failed (a peer of the pool died): nothing of it was recorded,
        the engine plans that work again."""

    def fail(self, request_id: str, error: str, retryable: bool = False) -> None:
        log.info("request %s failed: %s", request_id, error)
        self.stages.end(request_id, error)
        self.outbox.send_gateway(TokenDelta(request_id=request_id, error=error, retryable=retryable))

    def refuse_if_draining(self, msg: WorkerRequest) -> bool:
        if self.draining:
            self.fail(msg.request_id, f"worker {self.worker} is draining", retryable=True)
        return self.draining

    def load_report(self, with_expert_load: bool = False) -> LoadReport:
        return load_report(
            self.worker,
            self.incarnation,
            self.engine.load(with_expert_load),
            queued_elsewhere=self.num_queued_elsewhere(),
            transfers=self.transfer_counters(),
            stages=self.stages.histogram,
            steps=self.step_times,
            draining=self.draining,
        )

    def transfer_counters(self) -> TransferCounters:
        """KV transfers since start (none for a role without a connector)."""
        return TransferCounters()

    def num_queued_elsewhere(self) -> int:
        """Requests the role holds outside the scheduler's queues."""
        return 0


class ConnectorSide(Protocol):
    """What a PD role's worker asks of its side of the KV connector besides its messages."""

    counters: TransferCounters

    def tick(self, now: float) -> None: ...

    def busy(self) -> bool: ...


class ConnectedWorker(RoleWorker):
    """A PD role: its side of the KV connector has timed work, keeps the loop busy and counts
    the role's transfers."""

    connector: ConnectorSide

    def tick(self, now: float) -> None:
        self.connector.tick(now)

    def busy(self) -> bool:
        return self.has_work() or self.connector.busy()

    def transfer_counters(self) -> TransferCounters:
        return self.connector.counters


class ColocatedWorker(RoleWorker):
    """Prefill and decode on this rank: the engine as it is, behind the control plane."""

    role = "colocated"

    def handle(self, message: AnyMessage, now: float) -> None:
        if isinstance(message, GenerateRequest):
            if self.refuse_if_draining(message):
                return
            try:
                self.engine.add_request(
                    message.request_id,
                    message.prompt_token_ids,
                    message.params,
                    first_choice=message.choice,
                    output_token_ids=message.output_token_ids,
                )
            except ValueError as e:
                self.fail(message.request_id, str(e))
                return
            self.stages.start(message.request_id, message.traceparent, "generate")
        elif isinstance(message, Abort):
            abort_running(self.engine, self.outbox, message.request_id)
            self.stages.end(message.request_id, finish="abort")
        else:
            log.warning("colocated worker ignored %s", type(message).__name__)


def abort_running(engine: EngineFacade, outbox: Outbox, request_id: str) -> bool:
    """Abort a request the engine holds; its pages are freed and the gateway told."""
    if not engine.has_request(request_id):
        return False
    engine.abort_request(request_id)
    outbox.send_gateway(TokenDelta(request_id=request_id, finish_reason="abort"))
    return True
