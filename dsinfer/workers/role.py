"""What every worker role shares: the engine, the outbox, token deltas and load reports.

A role is driven by the rank loop (dsinfer/workers/rank.py): ``handle`` each control message,
``tick`` for time-driven work (transfer progress, timeouts), ``step`` for one engine forward when
the pool agreed to step. A role never blocks, and it uses only the engine's façade (the surface
listed in dsinfer/engine/engine.py).
"""

from __future__ import annotations

import dataclasses
import logging
from abc import ABC, abstractmethod
from typing import Protocol

import msgspec

from dsinfer.base.protocol import Abort, GenerateRequest, LoadReport, Message, TokenDelta, WorkerRequest
from dsinfer.engine.agreement import StepVotes
from dsinfer.engine.engine import LLMEngine
from dsinfer.engine.step import StepPlan

log = logging.getLogger("dsinfer.worker")


class Outbox(Protocol):
    def send_gateway(self, message: msgspec.Struct) -> None: ...

    def send_peer(self, inbox: str, message: msgspec.Struct) -> None: ...


@dataclasses.dataclass
class TransferCounters:
    bytes: int = 0
    seconds: float = 0.0
    count: int = 0


class RoleWorker(ABC):
    role: str

    def __init__(self, engine: LLMEngine, outbox: Outbox, worker: str, incarnation: str) -> None:
        self.engine, self.outbox, self.worker, self.incarnation = engine, outbox, worker, incarnation
        self.transfer = TransferCounters()
        self.draining = False

    @abstractmethod
    def handle(self, message: Message, now: float) -> None: ...

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
            self.outbox.send_gateway(update.delta())

    def step_interrupted(self) -> None:  # noqa: B027 - roles without per-step state need none
        """The step's collectives failed (a peer of the pool died): nothing of it was recorded,
        the engine plans that work again."""

    def fail(self, request_id: str, error: str, retryable: bool = False) -> None:
        log.info("request %s failed: %s", request_id, error)
        self.outbox.send_gateway(TokenDelta(request_id=request_id, error=error, retryable=retryable))

    def refuse_if_draining(self, msg: WorkerRequest) -> bool:
        if self.draining:
            self.fail(msg.request_id, f"worker {self.worker} is draining", retryable=True)
        return self.draining

    def load_report(self, with_expert_load: bool = False) -> LoadReport:
        report = self.engine.load_report(
            self.worker,
            self.incarnation,
            num_queued_elsewhere=self.num_queued_elsewhere(),
            with_expert_load=with_expert_load,
        )
        report.transfer_bytes, report.transfer_seconds = self.transfer.bytes, self.transfer.seconds
        report.transfers, report.draining = self.transfer.count, self.draining
        return report

    def num_queued_elsewhere(self) -> int:
        """Requests the role holds outside the scheduler's queues."""
        return 0


class ColocatedWorker(RoleWorker):
    """Prefill and decode on this rank: the engine as it is, behind the control plane."""

    role = "colocated"

    def handle(self, message: Message, now: float) -> None:
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
        elif isinstance(message, Abort):
            abort_running(self.engine, self.outbox, message.request_id)
        else:
            log.warning("colocated worker ignored %s", type(message).__name__)


def abort_running(engine: LLMEngine, outbox: Outbox, request_id: str) -> bool:
    """Abort a request the engine holds; its pages are freed and the gateway told."""
    if not engine.has_request(request_id):
        return False
    engine.abort_request(request_id)
    outbox.send_gateway(TokenDelta(request_id=request_id, finish_reason="abort"))
    return True
