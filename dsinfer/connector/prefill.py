"""The prefill rank's side of the handoff: compute prompts, write their KV into decode ranks'
pages layer by layer.

Per request: the engine prefills it (chunked, prefix cache) and samples the first token. Before
each forward this side plans, per request in the batch, the prompt pages that are complete after
the step and not yet sent (from the decode side's first uncached page); the engine's per-layer
hook starts the write of layer l as soon as layer l's KV is written, so transfers of the first
layers run while later layers compute. A pool that keeps a state beside its pages (DeepSeek-V4)
sends whole pages only, and once the prompt is done the resume point at the last of them through
a handoff slot (dsinfer/engine/kv_pages.py); PrefillDone says how many tokens that covers.
Pages being read by a write hold an extra reference (they cannot be evicted or reused) until
that write is done, and a handoff slot stays taken until its write is done. When the first token is known and every
write is done, PrefillDone goes to the decode rank: it is the fence after which the decode side
may read the pages. An abort stops scheduling, waits for the writes in flight, then sends
TransferAborted (the fence for an aborted transfer). An abort from a decode rank
(``Abort.fence_to``) of a request this rank never got is answered with TransferAborted at once,
and the request is refused should it still arrive within ``quarantine`` seconds (the gateway's
PrefillRequest and the decode rank's Abort travel different sockets, in either order).

While it holds a request (queued behind other prompts, computing, writing) this side tells the
decode rank so, every ``progress_interval`` s (TransferProgress; ``PROGRESS_INTERVAL`` by default): the decode rank's deadline
measures silence, so a long prefill queue never times an accepted request out.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field

from dsinfer.base.protocol import Abort
from dsinfer.base.stages import RequestStages
from dsinfer.base.tracing import Interval, Tracer
from dsinfer.connector.messages import (
    PROGRESS_INTERVAL,
    PrefillDone,
    PrefillRequest,
    TransferAborted,
    TransferProgress,
)
from dsinfer.connector.outbox import Fail, Outbox, TransferCounters
from dsinfer.engine.facade import EngineFacade
from dsinfer.engine.step import LayerHook, ScheduledWork, SeqUpdate
from dsinfer.transfer.base import TransferBackend, TransferError, TransferHandle

log = logging.getLogger("dsinfer.connector")


@dataclass
class _Write:
    handle: TransferHandle
    pages: list[int]  # retained while the write reads them
    slot: int | None = None  # a handoff slot it reads, given back when it is done


@dataclass
class _Outgoing:
    msg: PrefillRequest
    first_page: int  # prompt pages before this one the decode rank already holds
    sent: set[int] = field(default_factory=set)  # prompt page indices whose writes were started
    in_flight: list[_Write] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)  # the sequence's pages, as its last step had them
    computed_tokens: int | None = None  # V4: tokens the decode rank gets KV for (None: all)
    bytes_written: int = 0
    bytes_by_group: dict[str, int] = field(default_factory=dict)
    started: float | None = None
    done: SeqUpdate | None = None  # the finished prefill's last update (first token sampled)
    forward_done_at: float = 0.0  # time.time() when the step that sampled the first token ended
    aborted: bool = False
    error: str | None = None


class PrefillConnector:
    def __init__(
        self,
        engine: EngineFacade,
        outbox: Outbox,
        backend: TransferBackend,
        fail: Fail,
        *,
        quarantine: float,
        progress_interval: float = PROGRESS_INTERVAL,
        stages: RequestStages | None = None,
    ) -> None:
        self.engine, self.outbox, self.backend, self.fail = engine, outbox, backend, fail
        # stages of a request's span here: prefill.queue, prefill.forward, kv_flush (the last
        # writes after the forward); kv_transfer beside them, from the first write to the last
        self.stages = (
            stages if stages is not None else RequestStages(Tracer("dsinfer-prefill", None), "prefill")
        )
        self.quarantine, self.progress_interval = quarantine, progress_interval
        self.counters = TransferCounters()
        self.page_size = engine.kv_pages.page_size
        self.page_bytes = engine.kv_pages.page_bytes
        self.page_groups = engine.kv_pages.page_groups
        self._fenced_unseen: dict[str, float] = {}  # fenced before it arrived -> when to forget it (in order)
        self._out: dict[str, _Outgoing] = {}
        self._planned: list[tuple[_Outgoing, list[int]]] = []  # the last step's new pages per request
        self._last_progress = float("-inf")

    # Messages --------------------------------------------------------------------------------
    def start(self, msg: PrefillRequest) -> None:
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
        known = len(msg.prompt_token_ids) + len(msg.output_token_ids)
        expected = self.engine.kv_pages.pages_for(known) - first_page
        if len(dest.pages) != expected:
            self.engine.abort_request(msg.request_id)
            self.fail(msg.request_id, f"decode gave {len(dest.pages)} pages for {expected} to send")
            return
        self._out[msg.request_id] = _Outgoing(msg, first_page)
        self.stages.start(msg.request_id, msg.traceparent, "prefill.queue")

    def abort(self, abort: Abort, now: float) -> bool:
        """Stop a transfer (its fence follows once its writes finished); False when this side
        does not hold the request."""
        request_id = abort.request_id
        out = self._out.get(request_id)
        if out is None:
            if abort.fence_to:  # nothing of it is or will be written: fence at once
                self._fenced_unseen[request_id] = now + self.quarantine
                self.outbox.send_peer(abort.fence_to, TransferAborted(request_id=request_id))
            return False
        out.aborted = True
        if self.engine.has_request(request_id):
            self.engine.abort_request(request_id)
        return True

    # Steps -------------------------------------------------------------------------------------
    def layer_hook_for(self, work: list[ScheduledWork]) -> LayerHook | None:
        """Plan the coming step's KV writes; the hook starts them layer by layer."""
        plan: list[tuple[_Outgoing, list[int], list[int]]] = []
        self._planned = []
        for seq in work:
            out = self._out.get(seq.request_id)
            if out is None or out.aborted:
                continue
            out.pages = seq.pages
            last = min(seq.end, seq.context_len)
            partial = last == seq.context_len and self.engine.kv_pages.sends_partial_pages
            complete = -(-last // self.page_size) if partial else last // self.page_size
            new = [p for p in range(out.first_page, complete) if p not in out.sent]
            if not new:
                continue
            out.sent.update(new)
            self._planned.append((out, new))
            self.stages.mark(seq.request_id, "prefill.forward")
            src = [seq.pages[p] for p in new]
            dst = [out.msg.destination.pages[p - out.first_page] for p in new]
            plan.append((out, src, dst))
        if not plan:
            return None

        def after_layer(layer: int) -> None:
            if not self.page_bytes[layer]:
                return  # a layer with nothing in pages (V4's sliding-window layers)
            for out, src, dst in plan:
                self._write(out, layer, src, dst)

        return after_layer

    def _write(
        self, out: _Outgoing, layer: int, src: list[int], dst: list[int], slot: int | None = None
    ) -> bool:
        """Start one write; False when it did not start (the transfer failed before or now)."""
        if out.error is not None:
            return False
        try:
            handle = self.backend.write_pages(out.msg.decode_agent, layer, src, dst)
        except TransferError as e:
            out.error = f"KV write to {out.msg.destination.worker} failed: {e}"
            return False
        if slot is None:
            self.engine.kv_pages.retain(src)
        out.in_flight.append(_Write(handle, [] if slot is not None else src, slot))
        out.bytes_written += len(src) * self.page_bytes[layer]
        for group, n in self.page_groups[layer].items():
            out.bytes_by_group[group] = out.bytes_by_group.get(group, 0) + len(src) * n
        out.started = out.started or time.monotonic()
        return True

    def _hand_over(self, out: _Outgoing) -> None:
        """The prompt is done: write the resume point at its last whole page, if the pool keeps
        one, into the decode rank's slot (V4); else it computes from its own cached tokens."""
        kv, dest = self.engine.kv_pages, out.msg.destination
        if kv.handoff_layer is None or dest.handoff_slot is None:
            return
        known = len(out.msg.prompt_token_ids) + len(out.msg.output_token_ids)
        staged = kv.stage_handoff(out.pages, known)
        out.computed_tokens = dest.num_cached_tokens
        if staged is None:
            return
        slot, position = staged
        if position > dest.num_cached_tokens and self._write(
            out, kv.handoff_layer, [slot], [dest.handoff_slot], slot
        ):
            out.computed_tokens = position
        else:  # the decode rank's own cache goes as far, or the transfer failed: no point to send
            kv.release_handoff(slot)

    def stepped(self, updates: list[SeqUpdate]) -> None:
        """Record the step's finished prefills (the decode rank sends the tokens, not this one)."""
        for update in updates:
            out = self._out.get(update.request_id)
            if out is not None and update.finished and update.finish_reason != "abort":
                out.done, out.forward_done_at = update, time.time()
                self._hand_over(out)
                self.stages.mark(update.request_id, "kv_flush")

    def step_interrupted(self) -> None:
        """Pages the interrupted step was writing are written again, every layer, when the step
        that computes them again runs (writes already posted land the same bytes)."""
        for out, pages in self._planned:
            out.sent.difference_update(pages)
        self._planned = []

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
                if out.error is not None:  # a write failed: the decode rank or its link is gone
                    self.fail(request_id, out.error, True)
                    if self.engine.has_request(request_id):
                        self.engine.abort_request(request_id)
                self.outbox.send_peer(out.msg.decode_inbox, TransferAborted(request_id=request_id))
                self.stages.end(request_id, out.error, finish="abort")
                del self._out[request_id]
            elif out.done is not None:
                self._finish(out, now)
                transfer = Interval(
                    "kv_transfer", _wall(out.started), time.time(), {"dsinfer.bytes": out.bytes_written}
                )
                self.stages.end(request_id, finish="prefilled", extra=[transfer] if out.started else [])
                del self._out[request_id]
        if now - self._last_progress >= self.progress_interval:
            self._send_progress()
            self._last_progress = now

    def busy(self) -> bool:
        return bool(self._out)

    def num_done_waiting(self) -> int:
        """Requests whose prefill finished and whose writes are still in flight."""
        return sum(1 for out in self._out.values() if out.done is not None)

    def _send_progress(self) -> None:
        by_inbox: dict[str, list[str]] = defaultdict(list)
        for request_id, out in self._out.items():
            if not out.aborted and out.error is None:
                by_inbox[out.msg.decode_inbox].append(request_id)
        for inbox, request_ids in by_inbox.items():
            self.outbox.send_peer(inbox, TransferProgress(request_ids=request_ids))

    def _poll(self, out: _Outgoing) -> None:
        pending = []
        for write in out.in_flight:
            state = self.backend.poll(write.handle)
            if state == "pending":
                pending.append(write)
                continue
            self.backend.release(write.handle)
            if write.slot is not None:
                self.engine.kv_pages.release_handoff(write.slot)
            else:
                self.engine.kv_pages.release(write.pages)
            if state == "failed" and out.error is None:
                out.error = f"KV write to {out.msg.destination.worker} failed"
        out.in_flight = pending

    def _finish(self, out: _Outgoing, now: float) -> None:
        assert out.done is not None
        done = out.done
        if out.started is not None:
            self.counters.seconds += now - out.started
        self.counters.bytes += out.bytes_written
        self.counters.add_groups(out.bytes_by_group)
        self.counters.count += 1
        self.outbox.send_peer(
            out.msg.decode_inbox,
            PrefillDone(
                request_id=done.request_id,
                first_token=done.new_token_ids[0],
                first_logprobs=done.new_logprobs[0] if done.new_logprobs else None,
                prompt_logprobs=done.prompt_logprobs if done.is_first else None,
                num_cached_tokens=done.num_cached_prompt_tokens if done.is_first else 0,
                mtp_draft=done.mtp_draft,
                computed_tokens=out.computed_tokens,
                bytes_written=out.bytes_written,
                bytes_by_group=out.bytes_by_group,
                first_write_at=_wall(out.started),
                forward_done_at=out.forward_done_at,
            ),
        )


def _wall(monotonic: float | None) -> float:
    """A monotonic instant as time.time() (timestamps that cross processes)."""
    if monotonic is None:
        return 0.0
    return time.time() - (time.monotonic() - monotonic)
