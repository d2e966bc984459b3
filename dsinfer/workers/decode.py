"""PD decode role: reserve pages for incoming prompts, receive their KV, decode.

DecodeAdmit -> the request queues until the scheduler can reserve its prompt pages (seats and
KV permitting), then KVDestination tells the gateway where the prefill rank writes. PrefillDone
(sent by the prefill rank after its last write completed) joins the request to the running batch
with its first token. Reserved pages of a transfer that ends any other way (abort, timeout, the
prefill side giving up) go to quarantine: they return to the pool only when the prefill rank
confirms no write can land (TransferAborted, which it sends at once for a request it never got,
or a late PrefillDone), when the gateway reports
the prefill rank dead (PeerDown), or after ``quarantine`` seconds, so a late write never lands
in a page given to another request.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from dsinfer.base.protocol import (
    Abort,
    DecodeAdmit,
    KVDestination,
    Message,
    PeerDown,
    PrefillDone,
    TokenDelta,
    TransferAborted,
)
from dsinfer.engine.engine import LLMEngine
from dsinfer.engine.step import RemotePrefill
from dsinfer.workers.role import Outbox, RoleWorker, abort_running

log = logging.getLogger("dsinfer.worker")


@dataclass
class _Incoming:
    msg: DecodeAdmit
    request: RemotePrefill
    deadline: float = 0.0  # monotonic; set once the pages are reserved


class DecodeWorker(RoleWorker):
    role = "decode"

    def __init__(
        self,
        engine: LLMEngine,
        outbox: Outbox,
        worker: str,
        incarnation: str,
        *,
        inbox: str,
        transfer_timeout: float,
        quarantine: float,
    ) -> None:
        super().__init__(engine, outbox, worker, incarnation)
        self.inbox = inbox  # where prefill ranks send this rank's fences
        self.transfer_timeout, self.quarantine = transfer_timeout, quarantine
        self._queued: deque[_Incoming] = deque()  # waiting for seats or pages
        self._reserved: dict[str, _Incoming] = {}  # pages held, waiting for PrefillDone
        self._quarantined: dict[str, tuple[list[int], float, str]] = {}  # pages, release time, prefill rank

    # Messages --------------------------------------------------------------------------------
    def handle(self, message: Message, now: float) -> None:
        if isinstance(message, DecodeAdmit):
            self._admit(message, now)
        elif isinstance(message, PrefillDone):
            self._join(message, now)
        elif isinstance(message, TransferAborted):
            self._fenced(message.request_id)
        elif isinstance(message, Abort):
            self._abort(message.request_id, now)
        elif isinstance(message, PeerDown):
            self._peer_down(message.worker)
        else:
            log.warning("decode worker ignored %s", type(message).__name__)

    def _admit(self, msg: DecodeAdmit, now: float) -> None:
        if self.refuse_if_draining(msg):
            return
        try:
            request = self.engine.new_remote_prefill(
                msg.request_id, msg.prompt_token_ids, msg.params, msg.choice, msg.output_token_ids
            )
        except ValueError as e:
            self.fail(msg.request_id, str(e))
            return
        self._queued.append(_Incoming(msg, request))
        self._reserve_queued(now)

    def _reserve_queued(self, now: float) -> None:
        while self._queued:
            reservation = self.engine.reserve_remote_prefill(self._queued[0].request)
            if reservation is None:
                return
            item = self._queued.popleft()
            item.deadline = now + self.transfer_timeout
            self._reserved[item.msg.request_id] = item
            self.outbox.send_gateway(
                KVDestination(
                    request_id=item.msg.request_id,
                    worker=self.worker,
                    num_cached_tokens=reservation.num_cached_tokens,
                    pages=reservation.pages,
                )
            )

    def _join(self, done: PrefillDone, now: float) -> None:
        item = self._reserved.pop(done.request_id, None)
        if item is None:  # aborted meanwhile: the message is the fence for its pages
            self._fenced(done.request_id)
            return
        if done.first_write_at:
            self.transfer.seconds += max(0.0, done.forward_done_at - done.first_write_at)
        self.transfer.bytes += done.bytes_written
        self.transfer.count += 1
        update = self.engine.join_remote_prefill(
            item.request, done.first_token, done.first_logprobs, done.prompt_logprobs, done.mtp_draft
        )
        self.outbox.send_gateway(update.delta(num_cached_tokens=done.num_cached_tokens))

    def _fenced(self, request_id: str) -> None:
        """No write of ``request_id``'s transfer can land any more."""
        held = self._quarantined.pop(request_id, None)
        if held is not None:
            self.engine.release_pages(held[0])
            return
        item = self._reserved.pop(request_id, None)
        if item is not None:  # the prefill side gave up on its own
            self.engine.release_pages(self.engine.cancel_remote_prefill(item.request))
            self.fail(request_id, f"prefill rank {item.msg.prefill_worker} aborted the KV transfer")

    def _peer_down(self, prefill_worker: str) -> None:
        """Every transfer from the dead prefill rank is fenced: its pages are free again."""
        fenced = [rid for rid, held in self._quarantined.items() if held[2] == prefill_worker]
        fenced += [rid for rid, item in self._reserved.items() if item.msg.prefill_worker == prefill_worker]
        if fenced:
            log.info("prefill rank %s is dead: %d transfers from it fenced", prefill_worker, len(fenced))
        for request_id in fenced:
            self._fenced(request_id)

    def _abort(self, request_id: str, now: float) -> None:
        for item in self._queued:
            if item.msg.request_id == request_id:
                self._queued.remove(item)
                self.outbox.send_gateway(TokenDelta(request_id=request_id, finish_reason="abort"))
                return
        if request_id in self._reserved:
            self._give_up(request_id, now)
            self.outbox.send_gateway(TokenDelta(request_id=request_id, finish_reason="abort"))
            return
        abort_running(self.engine, self.outbox, request_id)

    def _give_up(self, request_id: str, now: float) -> None:
        item = self._reserved.pop(request_id)
        pages = self.engine.cancel_remote_prefill(item.request)
        self._quarantined[request_id] = (pages, now + self.quarantine, item.msg.prefill_worker)
        self.outbox.send_peer(item.msg.prefill_inbox, Abort(request_id=request_id, fence_to=self.inbox))

    # Progress ----------------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        for request_id, item in list(self._reserved.items()):
            if now >= item.deadline:
                self._give_up(request_id, now)
                self.fail(
                    request_id,
                    f"KV transfer from {item.msg.prefill_worker} timed out after {self.transfer_timeout:g} s",
                )
        for request_id, (pages, release_at, _) in list(self._quarantined.items()):
            if now >= release_at:
                log.info("quarantine of %s expired; %d pages released", request_id, len(pages))
                del self._quarantined[request_id]
                self.engine.release_pages(pages)
        self._reserve_queued(now)

    def busy(self) -> bool:
        return self.has_work() or bool(self._queued or self._reserved or self._quarantined)

    def num_queued_elsewhere(self) -> int:
        return len(self._queued) + len(self._reserved)
