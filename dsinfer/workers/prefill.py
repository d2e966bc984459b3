"""PD prefill role: compute prompts, write their KV into decode ranks' pages layer by layer.

Per request: the engine prefills it (chunked, prefix cache) and samples the first token. Before
each forward the role plans, per request in the batch, the prompt pages that are complete after
this step and not yet sent (from the decode side's first uncached page); the model's per-layer
callback starts the write of layer l as soon as layer l's KV is written, so transfers of the
first layers run while later layers compute. Pages being read by a write hold an extra
reference (they cannot be evicted or reused) until that write is done. When the first token is
known and every write is done, PrefillDone goes to the decode rank: it is the fence after which
the decode side may read the pages. An abort stops scheduling, waits for the writes in flight,
then sends TransferAborted (the fence for an aborted transfer). An abort from a decode rank
(``Abort.fence_to``) of a request this rank never got is answered with TransferAborted at once, and
the request is refused should it still arrive within ``quarantine`` seconds (the gateway's
PrefillRequest and the decode rank's Abort travel different sockets, in either order).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from dsinfer.base.protocol import (
    Abort,
    Message,
    PrefillDone,
    PrefillRequest,
    TransferAborted,
)
from dsinfer.engine.agreement import StepVotes
from dsinfer.engine.engine import LLMEngine
from dsinfer.engine.step import LayerHook, ScheduledWork, SeqUpdate, StepPlan
from dsinfer.transfer.base import TransferBackend, TransferError, TransferHandle
from dsinfer.workers.role import Outbox, RoleWorker

log = logging.getLogger("dsinfer.worker")


@dataclass
class _Outgoing:
    msg: PrefillRequest
    first_page: int  # prompt pages before this one the decode rank already holds
    sent: set[int] = field(default_factory=set)  # prompt page indices whose writes were started
    in_flight: list[tuple[TransferHandle, list[int]]] = field(default_factory=list)  # + pages retained
    bytes_written: int = 0
    started: float | None = None
    done: SeqUpdate | None = None  # the finished prefill's last update (first token sampled)
    forward_done_at: float = 0.0  # time.time() when the step that sampled the first token ended
    aborted: bool = False
    error: str | None = None


class PrefillWorker(RoleWorker):
    role = "prefill"

    def __init__(
        self,
        engine: LLMEngine,
        outbox: Outbox,
        worker: str,
        incarnation: str,
        transfer: TransferBackend,
        *,
        quarantine: float,
    ) -> None:
        super().__init__(engine, outbox, worker, incarnation)
        self.quarantine = quarantine
        self._fenced_unseen: dict[str, float] = {}  # fenced before it arrived -> when to forget it (in order)
        self.backend = transfer
        self.page_size = engine.page_size
        self.page_bytes = engine.kv_page_bytes
        self._out: dict[str, _Outgoing] = {}
        self._planned: list[tuple[_Outgoing, list[int]]] = []  # the last step's new pages per request

    # Messages --------------------------------------------------------------------------------
    def handle(self, message: Message, now: float) -> None:
        if isinstance(message, PrefillRequest):
            self._start(message)
        elif isinstance(message, Abort):
            self._abort(message, now)
        else:
            log.warning("prefill worker ignored %s", type(message).__name__)

    def _start(self, msg: PrefillRequest) -> None:
        if self.refuse_if_draining(msg):
            return
        if msg.request_id in self._fenced_unseen:
            self.fail(msg.request_id, "aborted before it reached this prefill rank")
            return
        dest = msg.destination
        if dest.num_cached_tokens % self.page_size:
            self.fail(msg.request_id, f"decode cached {dest.num_cached_tokens} tokens, not whole pages")
            return
        try:
            self.backend.connect(msg.decode_agent, msg.decode_transfer_metadata)
            self.engine.add_request(
                msg.request_id,
                msg.prompt_token_ids,
                msg.params,
                first_choice=msg.choice,
                prefill_only=True,
                output_token_ids=msg.output_token_ids,
            )
        except (ValueError, TransferError) as e:
            self.fail(msg.request_id, str(e))
            return
        first_page = dest.num_cached_tokens // self.page_size
        expected = self.engine.pages_for(len(msg.prompt_token_ids) + len(msg.output_token_ids)) - first_page
        if len(dest.pages) != expected:
            self.engine.abort_request(msg.request_id)
            self.fail(msg.request_id, f"decode gave {len(dest.pages)} pages for {expected} to send")
            return
        self._out[msg.request_id] = _Outgoing(msg, first_page)

    def _abort(self, abort: Abort, now: float) -> None:
        request_id = abort.request_id
        out = self._out.get(request_id)
        if out is None:
            if abort.fence_to:  # nothing of it is or will be written: fence at once
                self._fenced_unseen[request_id] = now + self.quarantine
                self.outbox.send_peer(abort.fence_to, TransferAborted(request_id=request_id))
            return
        out.aborted = True
        if self.engine.has_request(request_id):
            self.engine.abort_request(request_id)

    # Step --------------------------------------------------------------------------------------
    def step(self, plan: StepPlan, agreed: StepVotes) -> None:
        for update in self.engine.run_step(plan, agreed, self._plan_writes):
            out = self._out.get(update.request_id)
            if out is not None and update.finished and update.finish_reason != "abort":
                out.done, out.forward_done_at = update, time.time()

    def step_interrupted(self) -> None:
        """Pages the interrupted step was writing are written again, every layer, when the step
        that computes them again runs (writes already posted land the same bytes)."""
        for out, pages in self._planned:
            out.sent.difference_update(pages)
        self._planned = []

    def _plan_writes(self, work: list[ScheduledWork]) -> LayerHook | None:
        plan: list[tuple[_Outgoing, list[int], list[int]]] = []
        self._planned = []
        for seq in work:
            out = self._out.get(seq.request_id)
            if out is None or out.aborted:
                continue
            last = min(seq.end, seq.context_len)
            complete = -(-last // self.page_size) if last == seq.context_len else last // self.page_size
            new = [p for p in range(out.first_page, complete) if p not in out.sent]
            if not new:
                continue
            out.sent.update(new)
            self._planned.append((out, new))
            src = [seq.pages[p] for p in new]
            dst = [out.msg.destination.pages[p - out.first_page] for p in new]
            plan.append((out, src, dst))
        if not plan:
            return None

        def after_layer(layer: int) -> None:
            now = time.monotonic()
            for out, src, dst in plan:
                if out.error is not None:
                    continue
                try:
                    handle = self.backend.write_pages(out.msg.decode_agent, layer, src, dst)
                except TransferError as e:
                    out.error = f"KV write to {out.msg.destination.worker} failed: {e}"
                    continue
                self.engine.retain_pages(src)
                out.in_flight.append((handle, src))
                out.bytes_written += len(src) * self.page_bytes[layer]
                out.started = out.started or now

        return after_layer

    # Progress ----------------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        while self._fenced_unseen and now >= next(iter(self._fenced_unseen.values())):  # oldest first
            del self._fenced_unseen[next(iter(self._fenced_unseen))]
        for request_id in list(self._out):
            out = self._out[request_id]
            self._poll(out)
            if out.in_flight:
                continue
            if out.aborted or out.error is not None:
                if out.error is not None:
                    self.fail(request_id, out.error)
                    if self.engine.has_request(request_id):
                        self.engine.abort_request(request_id)
                self.outbox.send_peer(out.msg.decode_inbox, TransferAborted(request_id=request_id))
                del self._out[request_id]
            elif out.done is not None:
                self._finish(out, now)
                del self._out[request_id]

    def _poll(self, out: _Outgoing) -> None:
        pending = []
        for handle, pages in out.in_flight:
            state = self.backend.poll(handle)
            if state == "pending":
                pending.append((handle, pages))
                continue
            self.backend.release(handle)
            self.engine.release_pages(pages)
            if state == "failed" and out.error is None:
                out.error = f"KV write to {out.msg.destination.worker} failed"
        out.in_flight = pending

    def _finish(self, out: _Outgoing, now: float) -> None:
        assert out.done is not None
        first = out.done.delta()
        if out.started is not None:
            self.transfer.seconds += now - out.started
        self.transfer.bytes += out.bytes_written
        self.transfer.count += 1
        self.outbox.send_peer(
            out.msg.decode_inbox,
            PrefillDone(
                request_id=first.request_id,
                first_token=first.token_ids[0],
                first_logprobs=first.logprobs[0] if first.logprobs else None,
                prompt_logprobs=first.prompt_logprobs,
                num_cached_tokens=first.num_cached_tokens,
                mtp_draft=out.done.mtp_draft,
                bytes_written=out.bytes_written,
                first_write_at=_wall(out.started),
                forward_done_at=out.forward_done_at,
            ),
        )

    def has_work(self) -> bool:
        return self.engine.has_unfinished_requests()

    def busy(self) -> bool:
        return self.has_work() or bool(self._out)

    def num_queued_elsewhere(self) -> int:
        return sum(1 for out in self._out.values() if out.done is not None)


def _wall(monotonic: float | None) -> float:
    """A monotonic instant as time.time() (timestamps that cross processes)."""
    if monotonic is None:
        return 0.0
    return time.time() - (time.monotonic() - monotonic)
