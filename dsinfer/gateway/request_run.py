"""Running one HTTP request on the backend: jobs in, per-choice updates out, aborts and deadline.

A request becomes one ``Job`` per prompt (each with ``params.n`` choices); its choices are
numbered ``prompt_index * n + choice`` as OpenAI numbers them, once: each is one ``ChoiceState``
that the HTTP layer fills and the backend reads (its number and tokens).
Admission has two limits: while ``--max-queued-requests`` choices are queued (dispatched with no
first token yet: the backend's ``queue_length``), or while the queue would keep a new request
waiting for more than half its deadline (dsinfer/gateway/admission.py), a new request gets 429. The
request has one deadline (arrival + ``--request-timeout``): the backend hands every job's deltas to the
run's sink, which folds each into its choice's state and queues the ``(number, ChoiceUpdate)``
pairs that ``RequestRun.updates`` yields until every choice ended, raising ``RequestTimeout`` at
the deadline (``complete``, a whole response, queues only the choices' last updates). A choice that the
gateway ends on a stop string is aborted at its workers at once. ``close`` aborts what is still
running (client gone, timeout, error) and records the request's metrics.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from dsinfer.base.protocol import TokenDelta
from dsinfer.base.tokenizer import Tokenizer
from dsinfer.base.tracing import NO_SPAN, OpenSpan, Tracer
from dsinfer.gateway.admission import QueueDrain
from dsinfer.gateway.args import GatewayArgs
from dsinfer.gateway.backend import Backend, BackendMetrics, Job, JobHandle, Overloaded, Unavailable
from dsinfer.gateway.choice import ChoiceState, ChoiceUpdate
from dsinfer.gateway.errors import overloaded, server_error, unavailable
from dsinfer.gateway.intake import Preparer
from dsinfer.gateway.metrics import GatewayMetrics
from dsinfer.gateway.openai_api import PromptLogprob, PromptLogprobs, PromptTokensDetails, Usage
from dsinfer.gateway.prepare import Limits, Prepared
from dsinfer.gateway.reasoning import make_reasoning_parser

log = logging.getLogger("dsinfer.gateway")

RETRY_AFTER = 1.0  # seconds suggested to a client refused for overload


class RequestTimeout(Exception):
    pass


@dataclass
class GatewayContext:
    """What every handler of one app shares (kept on ``app.state.gateway``)."""

    backend: Backend
    tokenizer: Tokenizer
    args: GatewayArgs
    model_name: str  # what clients pass as ``model``
    vocab_size: int
    metrics: GatewayMetrics
    preparer: Preparer  # parsing, templating and tokenizing, off the event loop
    tracer: Tracer
    max_token_chars: int | None = None  # the tokenizer's bound on one token's characters
    draining: bool = False  # SIGTERM: new requests get 503, running streams finish
    queue_drain: QueueDrain = field(default_factory=QueueDrain)  # first tokens, for admission
    active_ids: set[str] = field(default_factory=set)
    _token_text: dict[int, str] = field(default_factory=dict)

    def is_ready(self, snapshot: BackendMetrics) -> bool:
        return snapshot.ready and not self.draining

    def limits(self) -> Limits:
        """The limits a request is validated against now; 503 before any pool registered."""
        capacity = self.backend.capacity()
        if capacity is None:
            raise unavailable("no worker pool has registered yet")
        return Limits(self.model_name, self.vocab_size, self.args.max_n, capacity, self.max_token_chars)

    def token_text(self, token_id: int, as_id: bool = False) -> str:
        """How a logprob names a token: its own text, or ``token_id:<id>`` (vLLM's option)."""
        if as_id:
            return f"token_id:{token_id}"
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def prompt_logprobs(
        self, raw: list[dict[int, float] | None] | None, as_id: bool
    ) -> PromptLogprobs | None:
        if raw is None:
            return None
        return [
            None
            if pos is None
            else {
                str(t): PromptLogprob(logprob=lp, decoded_token=self.token_text(t, as_id))
                for t, lp in pos.items()
            }
            for pos in raw
        ]


class RequestRun:
    def __init__(
        self,
        ctx: GatewayContext,
        request_id: str,
        prepared: Prepared,
        endpoint: str,
        *,
        reasoning: bool,
        arrival: float,
        span: OpenSpan = NO_SPAN,
    ) -> None:
        self.ctx = ctx
        self.span = span  # the HTTP request's: ended with the run
        self.request_id = request_id
        self.prepared = prepared
        self.endpoint = endpoint
        self.arrival = arrival  # time.monotonic() when the HTTP request came in
        self.deadline = arrival + ctx.args.request_timeout
        self.n = prepared.params.n
        parser = ctx.args.reasoning_parser if reasoning else None
        self.choices = [
            ChoiceState(
                ctx.tokenizer,
                number=number,
                stops=list(prepared.params.stop or []),
                skip_special_tokens=prepared.params.skip_special_tokens,
                include_stop_str=prepared.include_stop_str,
                reasoning=make_reasoning_parser(parser, prepared.thinking),
                tools=prepared.tool_format.parser() if prepared.tool_format is not None else None,
                incremental=prepared.stream,
            )
            for number in range(len(prepared.prompts) * self.n)
        ]
        self.jobs: list[JobHandle] = []
        # what wakes the request: (choice number, update) pairs, the deadline (None) or an
        # exception raised while folding a delta in
        self._wakes: asyncio.Queue[tuple[int, ChoiceUpdate] | BaseException | None] = asyncio.Queue()
        self._endings_only = False  # set by complete(): a whole response wakes only as choices end
        self._aborted: set[int] = set()
        self.first_token_time: float | None = None
        self.outcome = "ok"
        self._closed = False
        self._deadline_timer: asyncio.TimerHandle | None = None
        ctx.metrics.http_in_flight.inc()

    def start(self) -> None:
        """Submit every job, or raise a 429/503 APIError (``close`` aborts jobs already submitted)."""
        ctx, prepared = self.ctx, self.prepared
        queued, limit = ctx.backend.metrics_snapshot().queue_length, ctx.args.max_queued_requests
        if queued >= limit:
            self.outcome = "overloaded"
            raise overloaded(
                f"{queued} requests are queued (choices waiting for their first token); the limit is "
                f"{limit} (--max-queued-requests)",
                RETRY_AFTER,
            )
        too_long = ctx.queue_drain.refusal(queued, ctx.args.request_timeout, time.monotonic())
        if too_long is not None:
            self.outcome = "overloaded"
            raise overloaded(*too_long)
        others_preparing = ctx.preparer.preparing() > 0
        try:
            for index, ids in enumerate(prepared.prompts):
                job = Job(
                    self.request_id,
                    ids,
                    prepared.params,
                    deadline=self.deadline,
                    choices=self.choices[index * self.n : (index + 1) * self.n],
                    arrival_time=self.arrival,
                    traceparent=self.span.traceparent,
                    more_coming=others_preparing or index < len(prepared.prompts) - 1,
                )
                self.jobs.append(ctx.backend.submit(job, self._on_delta))
        except Overloaded as e:
            self.outcome = "overloaded"
            raise overloaded(str(e) or "the server is overloaded", e.retry_after) from None
        except Unavailable as e:
            self.outcome = "unavailable"
            raise unavailable(str(e) or "no healthy worker can serve the request") from None
        log.debug(
            "%s: %d job(s), n=%d, %d prompt tokens",
            self.request_id,
            len(self.jobs),
            self.n,
            self.prompt_tokens,
        )

    def _on_delta(self, number: int, delta: TokenDelta) -> None:
        """The backend's sink: folds the delta into its choice at once and wakes the request only
        when it has something to send (every update of a stream; a choice's end for a whole
        response, so that it is woken once per choice, not once per token)."""
        try:
            update = self._apply(number, delta)
        except Exception as e:  # raised in the request, not in the backend's message handler
            self._wakes.put_nowait(e)
            return
        if update is not None and (not self._endings_only or update.finished):
            self._wakes.put_nowait((number, update))

    async def updates(self) -> AsyncIterator[tuple[int, ChoiceUpdate]]:
        # one timer for the whole request, not one per awaited delta (a timed wait per token was
        # the largest part of the gateway's work per token)
        self._deadline_timer = asyncio.get_running_loop().call_later(
            max(0.0, self.deadline - time.monotonic()), self._wakes.put_nowait, None
        )
        while not (self.finished and self._wakes.empty()):
            wake = await self._wakes.get()
            if wake is None:
                if self.finished:
                    continue  # the deadline came after the last choice ended
                self.outcome = "timeout"
                await self.abort()
                raise RequestTimeout(f"request timed out after {self.ctx.args.request_timeout:g} s")
            if isinstance(wake, BaseException):
                raise wake
            number, update = wake
            if self.choices[number].stopped_by_string and update.finished:
                await self.jobs[number // self.n].abort(number)  # the workers may still be generating it
            yield number, update
        self._deadline_timer.cancel()

    async def complete(self) -> None:
        """Read every update into the choices' states; a failed choice aborts the run and raises a
        500 APIError."""
        self._endings_only = True
        async for _, update in self.updates():
            if update.error is not None:
                await self.abort()
                raise server_error(update.error)

    def _apply(self, number: int, delta: TokenDelta) -> ChoiceUpdate | None:
        if not 0 <= number < len(self.choices):
            log.warning(
                "%s: backend sent choice %d of a request with %d; ignored",
                self.request_id,
                number,
                len(self.choices),
            )
            return None
        if self.choices[number].finished:
            return None  # e.g. the workers' tokens after the stop string, until the abort reached them
        update = self.choices[number].update(delta)
        if update.first:
            self.ctx.queue_drain.started(time.monotonic())
        if update.token_ids and self.first_token_time is None:
            self.first_token_time = time.monotonic()
        if update.error is not None:
            self.outcome = "error"
        return update

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.choices)

    async def abort(self) -> None:
        """Abort every job that still has an unfinished choice (each job once)."""
        for job, handle in enumerate(self.jobs):
            if job in self._aborted:
                continue
            if any(not c.finished for c in self.choices[job * self.n : (job + 1) * self.n]):
                self._aborted.add(job)
                try:
                    await handle.abort()
                except Exception:
                    log.exception("%s: abort of job %d failed", self.request_id, job)

    async def close(self) -> None:
        """Abort what still runs, stop the deadline's timer, record metrics (once)."""
        if self._closed:
            return
        self._closed = True
        if not self.finished:
            await self.abort()
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
        self.ctx.active_ids.discard(self.request_id)
        self.ctx.metrics.http_in_flight.dec()
        self._record()
        usage = self.usage()
        self.span.set(
            {
                "dsinfer.outcome": self.outcome,
                "gen_ai.usage.input_tokens": usage.prompt_tokens,
                "gen_ai.usage.output_tokens": usage.completion_tokens,
            }
        )
        self.span.end(None if self.outcome == "ok" else self.outcome)

    # Results ----------------------------------------------------------------------------------
    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prepared.prompts)

    def usage(self) -> Usage:
        completion = sum(len(c.token_ids) for c in self.choices)
        cached = sum(
            self.choices[job * self.n].num_cached_tokens for job in range(len(self.prepared.prompts))
        )
        return Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=completion,
            total_tokens=self.prompt_tokens + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        )

    def _record(self) -> None:
        m, now = self.ctx.metrics, time.monotonic()
        usage = self.usage()
        m.prompt_tokens.inc(usage.prompt_tokens)
        m.generation_tokens.inc(usage.completion_tokens)
        if usage.prompt_tokens_details is not None:
            m.cached_tokens.inc(usage.prompt_tokens_details.cached_tokens)
        ttft = None if self.first_token_time is None else self.first_token_time - self.arrival
        if ttft is not None:
            m.ttft.observe(ttft)
        for c in self.choices:
            if c.first_token_time is not None and c.last_token_time is not None and len(c.token_ids) > 1:
                m.tpot.observe((c.last_token_time - c.first_token_time) / (len(c.token_ids) - 1))
        if self.outcome == "ok":
            m.e2e.observe(now - self.arrival)
        reasons = sorted({"error" if c.error else c.finish_reason or "unfinished" for c in self.choices})
        log.info(
            "%s %s: %s, %d prompt (%d cached) + %d completion tokens, finish %s, ttft %s, %.3f s",
            self.request_id,
            self.endpoint,
            self.outcome,
            usage.prompt_tokens,
            usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0,
            usage.completion_tokens,
            "/".join(reasons),
            "-" if ttft is None else f"{ttft:.3f} s",
            now - self.arrival,
        )


async def wait_for_disconnect(request: Request) -> None:
    """Returns once the client closed the connection (the body must have been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, run: RequestRun, work: Callable[[], Awaitable[Any]]) -> Any:
    """Await ``work()``; if the client goes away first, abort the run and raise ClientGone."""
    task = asyncio.create_task(work())
    watcher = asyncio.create_task(wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    run.outcome = "client gone"
    await run.close()
    raise ClientGone


class ClientGone(Exception):
    pass
