"""The decode rank's side of the handoff: reserve pages for incoming prompts, wait for their KV,
join them to the running batch.

DecodeAdmit -> the request queues until the engine can reserve its pages (seats and KV
permitting; for DeepSeek-V4 also a handoff slot), then KVDestination tells the gateway where the
prefill rank writes. PrefillDone (sent by the prefill rank after its last write completed) joins
the request with its first token; for V4 from the resume point the slot holds, this rank
computing the prompt's last partial page itself.

Deadlines measure silence, not the prefill rank's queue: a reserved transfer is given up after
``transfer_timeout`` seconds without a sign of it from the prefill rank, which sends
TransferProgress for every request it holds (queued behind other prompts, computing, writing)
every ``PROGRESS_INTERVAL`` s. (A deadline counted from the reservation failed accepted requests
under load: they waited their turn in the prefill queue longer than the timeout.)

A transfer that fails (silence, the prefill side giving up) ends the request's attempt with a
retryable error: the gateway dispatches it again to another pair, as after a rank's death.

Reserved pages of a transfer that ends any other way (abort, timeout, the prefill side giving up)
go to quarantine: they return to the pool only when the prefill rank confirms no write can land
(TransferAborted, which it sends at once for a request it never got, or a late PrefillDone), when
the gateway reports the prefill rank dead (PeerDown), or after ``quarantine`` seconds, so a late
write never lands in a page given to another request.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from dsinfer.base.protocol import Abort
from dsinfer.base.stages import RequestStages
from dsinfer.base.tracing import Tracer
from dsinfer.connector.messages import (
    DecodeAdmit,
    KVDestination,
    PrefillDone,
    TransferProgress,
)
from dsinfer.connector.outbox import Fail, Outbox, TransferCounters
from dsinfer.engine.facade import EngineFacade
from dsinfer.engine.step import RemotePrefill, SeqUpdate

log = logging.getLogger("dsinfer.connector")


@dataclass
class _Incoming:
    msg: DecodeAdmit
    request: RemotePrefill
    deadline: float = 0.0  # monotonic; set once the pages are reserved, renewed by progress
    num_cached_tokens: int = 0  # this rank's own prefix-cache hit
    handoff_slot: int | None = None  # V4: where the prefill rank writes the resume point


@dataclass(frozen=True)
class _Held:
    pages: list[int]
    slot: int | None
    release_at: float
    prefill_worker: str


@dataclass(frozen=True)
class Joined:
    """A transfer that completed: the request's first update, and the prompt tokens the prefill
    rank served from its own cache (the client's ``cached_tokens``)."""

    update: SeqUpdate
    num_cached_tokens: int


class DecodeConnector:
    def __init__(
        self,
        engine: EngineFacade,
        outbox: Outbox,
        worker: str,
        fail: Fail,
        *,
        inbox: str,
        transfer_timeout: float,
        quarantine: float,
        stages: RequestStages | None = None,
    ) -> None:
        self.engine, self.outbox, self.worker, self.fail = engine, outbox, worker, fail
        # stages of a request's span here: decode.queue (seats, pages), kv_wait, then the worker's
        self.stages = (
            stages if stages is not None else RequestStages(Tracer("dsinfer-decode", None), "decode")
        )
        self.inbox = inbox  # where prefill ranks send this rank's fences and progress
        self.transfer_timeout, self.quarantine = transfer_timeout, quarantine
        self.counters = TransferCounters()
        self._queued: deque[_Incoming] = deque()  # waiting for seats or pages
        self._reserved: dict[str, _Incoming] = {}  # pages held, waiting for PrefillDone
        self._quarantined: dict[str, _Held] = {}  # what a late write could still land in

    # Messages --------------------------------------------------------------------------------
    def admit(self, msg: DecodeAdmit, now: float) -> None:
        try:
            request = self.engine.remote.new(
                msg.request_id, msg.prompt_token_ids, msg.params, msg.choice, msg.output_token_ids
            )
        except ValueError as e:
            self.fail(msg.request_id, str(e))
            return
        self._queued.append(_Incoming(msg, request))
        self.stages.start(msg.request_id, msg.traceparent, "decode.queue")
        self._reserve_queued(now)

    def done(self, done: PrefillDone) -> Joined | None:
        """The transfer completed: the request joins the running batch (None: it was given up
        meanwhile, and the message is the fence for its pages)."""
        item = self._reserved.pop(done.request_id, None)
        if item is None:
            self.fenced(done.request_id)
            return None
        if done.first_write_at:
            self.counters.seconds += max(0.0, done.forward_done_at - done.first_write_at)
        self.counters.bytes += done.bytes_written
        self.counters.add_groups(done.bytes_by_group)
        self.counters.count += 1
        computed = done.computed_tokens
        if item.handoff_slot is not None:
            computed = max(computed or 0, item.num_cached_tokens)
            if computed > item.num_cached_tokens:  # the resume point arrived in the slot
                self.engine.kv_pages.adopt_handoff(
                    item.handoff_slot, self.engine.remote.pages(item.request), computed
                )
            else:
                self.engine.kv_pages.release_handoff(item.handoff_slot)
        update = self.engine.remote.join(
            item.request,
            done.first_token,
            done.first_logprobs,
            done.prompt_logprobs,
            done.mtp_draft,
            computed,
        )
        self.stages.mark(done.request_id, "generate")
        return Joined(update, done.num_cached_tokens)

    def progress(self, msg: TransferProgress, now: float) -> None:
        """The prefill rank holds these transfers: their deadlines start again."""
        for request_id in msg.request_ids:
            item = self._reserved.get(request_id)
            if item is not None:
                item.deadline = now + self.transfer_timeout

    def fenced(self, request_id: str) -> None:
        """No write of ``request_id``'s transfer can land any more."""
        held = self._quarantined.pop(request_id, None)
        if held is not None:
            self._release(held.pages, held.slot)
            return
        item = self._reserved.pop(request_id, None)
        if item is not None:  # the prefill side gave up on its own
            self._release(self.engine.remote.cancel(item.request), item.handoff_slot)
            self.fail(request_id, f"prefill rank {item.msg.prefill_worker} aborted the KV transfer", True)

    def _release(self, pages: list[int], slot: int | None) -> None:
        self.engine.kv_pages.release(pages)
        if slot is not None:
            self.engine.kv_pages.release_handoff(slot)

    def peer_down(self, prefill_worker: str) -> None:
        """Every transfer from the dead prefill rank is fenced: its pages are free again."""
        fenced = [rid for rid, held in self._quarantined.items() if held.prefill_worker == prefill_worker]
        fenced += [rid for rid, item in self._reserved.items() if item.msg.prefill_worker == prefill_worker]
        if fenced:
            log.info("prefill rank %s is dead: %d transfers from it fenced", prefill_worker, len(fenced))
        for request_id in fenced:
            self.fenced(request_id)

    def abort(self, request_id: str, now: float) -> bool:
        """Drop a request still waiting for its KV; False when this side does not hold it."""
        for item in self._queued:
            if item.msg.request_id == request_id:
                self._queued.remove(item)
                return True
        if request_id in self._reserved:
            self._give_up(request_id, now)
            return True
        return False

    # Progress ----------------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        for request_id, item in list(self._reserved.items()):
            if now >= item.deadline:
                self._give_up(request_id, now)
                self.fail(
                    request_id,
                    f"no sign of the KV transfer from {item.msg.prefill_worker} for "
                    f"{self.transfer_timeout:g} s (--kv-transfer-timeout)",
                    True,
                )
        for request_id, held in list(self._quarantined.items()):
            if now >= held.release_at:
                log.info("quarantine of %s expired; %d pages released", request_id, len(held.pages))
                del self._quarantined[request_id]
                self._release(held.pages, held.slot)
        self._reserve_queued(now)

    def busy(self) -> bool:
        return bool(self._queued or self._reserved or self._quarantined)

    def num_waiting(self) -> int:
        """Requests held here, not yet in the engine's running batch."""
        return len(self._queued) + len(self._reserved)

    def _reserve_queued(self, now: float) -> None:
        kv = self.engine.kv_pages
        while self._queued:
            slot = kv.reserve_handoff() if kv.handoff_layer is not None else None
            if kv.handoff_layer is not None and slot is None:
                return
            reservation = self.engine.remote.reserve(self._queued[0].request)
            if reservation is None:
                if slot is not None:
                    kv.release_handoff(slot)
                return
            item = self._queued.popleft()
            item.deadline = now + self.transfer_timeout
            item.num_cached_tokens, item.handoff_slot = reservation.num_cached_tokens, slot
            self._reserved[item.msg.request_id] = item
            self.stages.mark(item.msg.request_id, "kv_wait")
            self.outbox.send_gateway(
                KVDestination(
                    request_id=item.msg.request_id,
                    worker=self.worker,
                    num_cached_tokens=reservation.num_cached_tokens,
                    pages=reservation.pages,
                    handoff_slot=slot,
                )
            )

    def _give_up(self, request_id: str, now: float) -> None:
        item = self._reserved.pop(request_id)
        pages = self.engine.remote.cancel(item.request)
        self._quarantined[request_id] = _Held(
            pages, item.handoff_slot, now + self.quarantine, item.msg.prefill_worker
        )
        self.outbox.send_peer(item.msg.prefill_inbox, Abort(request_id=request_id, fence_to=self.inbox))
