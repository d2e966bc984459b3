"""What every worker role shares: the engine, the outbox, token deltas and load reports.

A role is driven by the rank loop (dsinfer/workers/rank.py): ``handle`` each control message,
``tick`` for time-driven work (transfer progress, timeouts), ``step`` for one engine forward when
the pool agreed to step. A role never blocks.
"""

from __future__ import annotations

import dataclasses
import logging
from abc import ABC, abstractmethod
from typing import Protocol

import msgspec

from dsinfer.base.protocol import Abort, GenerateRequest, LoadReport, Message, TokenDelta, WorkerRequest
from dsinfer.base.sampling_params import SamplingParams
from dsinfer.engine.engine import LLMEngine, SeqUpdate

log = logging.getLogger("dsinfer.worker")


class Outbox(Protocol):
    def send_gateway(self, message: msgspec.Struct) -> None: ...

    def send_peer(self, inbox: str, message: msgspec.Struct) -> None: ...


@dataclasses.dataclass
class TransferCounters:
    bytes: int = 0
    seconds: float = 0.0
    count: int = 0


def request_params(msg: WorkerRequest) -> SamplingParams:
    """The request's parameters with its seed fixed (choices of one request share it)."""
    return dataclasses.replace(msg.params, seed=msg.seed)


def delta_of(update: SeqUpdate, num_cached_tokens: int | None = None) -> TokenDelta:
    """The TokenDelta of one step's update; the first one carries the prompt's facts."""
    seq = update.seq
    first = seq.num_output_tokens == len(update.new_token_ids)
    delta = TokenDelta(
        request_id=seq.request_id,
        token_ids=update.new_token_ids,
        logprobs=update.new_logprobs,
        finish_reason=seq.finish_reason,
        stop_text_len=seq.stop_text_len,
    )
    if first:
        delta.num_prompt_tokens = seq.prompt_len
        delta.num_cached_tokens = (
            seq.num_cached_prompt_tokens if num_cached_tokens is None else num_cached_tokens
        )
        delta.prompt_logprobs = seq.prompt_logprobs
    return delta


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

    def step(self) -> None:
        for update in self.engine.step_updates():
            self.outbox.send_gateway(delta_of(update))

    def fail(self, request_id: str, error: str, retryable: bool = False) -> None:
        log.info("request %s failed: %s", request_id, error)
        self.outbox.send_gateway(TokenDelta(request_id=request_id, error=error, retryable=retryable))

    def refuse_if_draining(self, msg: WorkerRequest) -> bool:
        if self.draining:
            self.fail(msg.request_id, f"worker {self.worker} is draining", retryable=True)
        return self.draining

    def load_report(self, with_expert_load: bool = False) -> LoadReport:
        engine = self.engine
        sched, kv = engine.scheduler, engine.kv
        prefills = [s for s in [*sched.waiting, *sched.running] if s.num_computed_tokens < s.prompt_len]
        stats = kv.stats
        return LoadReport(
            worker=self.worker,
            incarnation=self.incarnation,
            num_running=len(sched.running),
            num_waiting=len(sched.waiting) + self.num_queued_elsewhere(),
            kv_pages_used=kv.num_pages - kv.num_available_pages(),
            kv_pages_total=kv.num_pages,
            pending_prefill_tokens=sum(s.prompt_len - s.num_computed_tokens for s in prefills),
            pending_attention_load=sum(
                (s.prompt_len - s.num_computed_tokens) * s.prompt_len for s in prefills
            ),
            prompt_tokens=sched.stats.prompt_tokens_submitted,
            memory_hit_tokens=stats.memory_hit_tokens,
            disk_hit_tokens=stats.disk_hit_tokens,
            transfer_bytes=self.transfer.bytes,
            transfer_seconds=self.transfer.seconds,
            transfers=self.transfer.count,
            draining=self.draining,
            expert_load=engine.model.expert_load() if with_expert_load else None,
        )

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
                    request_params(message),
                    first_choice=message.choice,
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
