"""What the HTTP layer needs from whatever runs the requests (the router over worker pools).

``submit(job, sink)`` returns at once with a ``JobHandle`` or raises: ``Overloaded`` (-> 429 with
Retry-After), ``Unavailable`` (-> 503: no healthy worker of a needed role). Before it validates a
request against ``capacity`` the HTTP layer awaits ``until_ready(deadline)``: a backend that expects
ranks soon (a gateway that just started, whose ranks are registering) waits for them, within a bound
of its own, so that its first requests are not refused; one that has served already answers at once
(a pool restarting is a 503 the client retries). The backend hands each
``(choice number, TokenDelta)`` to ``sink``, on the gateway's event loop and in order, every choice
ending with one delta that has ``finish_reason`` or ``error`` set and nothing after it. The sink
must not block or raise (it is called from the backend's message handler, once per token of every
running choice: no await and no timer per token). ``abort`` (idempotent) ends every unfinished choice
(or the one given) with finish_reason "abort" and frees what the workers hold; the HTTP layer
calls it when the client disconnects, at the request's deadline, and for a choice it ended itself
on a stop string. ``capacity`` says what the registered pools can hold, so that a request none of
them could serve is refused with a 400 before it is submitted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from dsinfer.base.protocol import LoadReport, TokenDelta
from dsinfer.base.sampling_params import SamplingParams


class Overloaded(Exception):
    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Unavailable(Exception):
    pass


class ChoiceRecord(Protocol):
    """One choice of a request: the single record of it, kept by the HTTP layer
    (dsinfer/gateway/choice.py's ChoiceState) and read by the backend.

    ``number`` is the choice's one numbering: prompt index x n + its place among the prompt's n
    choices, as OpenAI numbers choices; sinks, ``abort`` and worker request ids all use it (its
    place, ``number % n``, is the sampler's key, as offline generation numbers choices).
    ``token_ids`` are the tokens the choice holds: every token the backend delivered to it over
    all its attempts, up to a stop string (a choice moved to another rank continues from them).
    """

    @property
    def number(self) -> int: ...

    @property
    def token_ids(self) -> list[int]: ...


@dataclass
class Job:
    """One prompt of a client request, with its ``params.n`` choices."""

    request_id: str  # the client request's id; worker request ids add choice and attempt
    prompt_token_ids: list[int]
    params: SamplingParams  # n may be > 1; seed None = the router draws one for all choices
    deadline: float  # time.monotonic() when the HTTP layer ends the request (a timeout); never retried after
    choices: Sequence[ChoiceRecord]  # its params.n choices, in order
    arrival_time: float = 0.0  # time.monotonic() at the HTTP layer
    traceparent: str = ""  # the HTTP request's span (dsinfer/base/tracing.py); "" = not traced
    more_coming: bool = False  # other requests were being prepared when this one was submitted


DeltaSink = Callable[[int, TokenDelta], None]  # (choice number, delta), on the gateway's event loop


class JobHandle(Protocol):
    async def abort(self, choice: int | None = None) -> None: ...  # a choice number, or all


@dataclass(frozen=True)
class Capacity:
    """What the registered ranks can hold; every rank agrees on ``max_model_len`` and the page size."""

    max_model_len: int
    page_size: int
    kv_pages: dict[str, int]  # role -> the KV pages of its largest registered rank

    def refusal(self, prompt_len: int, max_tokens: int | None) -> str | None:
        """Why no registered rank can hold the request (as the engines' own check would say), or
        None, also when no colocated rank nor a prefill and a decode rank is up to judge by (the
        router then refuses it as unavailable). ``max_tokens`` None: up to the context length."""
        generated = min(max_tokens or self.max_model_len, self.max_model_len - prompt_len)
        needed = -(-(prompt_len + generated) // self.page_size)
        prefill_needed = -(-(prompt_len + 1) // self.page_size)

        def holds(role: str, pages: int) -> bool:
            return self.kv_pages.get(role, 0) >= pages

        if holds("colocated", needed) or (holds("decode", needed) and holds("prefill", prefill_needed)):
            return None
        if "colocated" not in self.kv_pages and not {"prefill", "decode"} <= self.kv_pages.keys():
            return None  # no whole topology is up (a pool restarting): the router answers 503
        largest = max(self.kv_pages.values(), default=0)
        return (
            f"the request needs {needed} KV pages of {self.page_size} tokens ({prompt_len} prompt + "
            f"{generated} generated tokens), more than any registered pool holds (at most {largest} pages per rank)"
        )


class Backend(Protocol):
    def submit(self, job: Job, sink: DeltaSink) -> JobHandle: ...

    async def until_ready(self, deadline: float) -> bool: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def metrics_snapshot(self) -> BackendMetrics: ...

    def capacity(self) -> Capacity | None: ...


@dataclass
class WorkerStatus:
    worker: str
    role: str
    healthy: bool
    report: LoadReport  # its last load report (an empty one, with its KV size, before the first)


MIGRATION_CAUSES = ("rank_died", "unresponsive", "unreachable", "drained", "refused")
POOL_EVENTS = ("pool_restarted", "rank_died", "rank_rejoined")


@dataclass
class MigrationStats:
    """Choices moved to other ranks (their rank died, stopped answering, was unreachable or
    refused them), by cause and by whether they had streamed tokens (a continuation); and the
    time from each move to the moved choice's next token (its recovery)."""

    moves: dict[tuple[str, bool], int] = field(default_factory=dict)  # (cause, streaming) -> count
    resumed: int = 0
    resume_seconds: float = 0.0  # summed over ``resumed``

    def moved(self, cause: str, *, streaming: bool) -> None:
        self.moves[cause, streaming] = self.moves.get((cause, streaming), 0) + 1

    def resumed_after(self, seconds: float) -> None:
        self.resumed += 1
        self.resume_seconds += seconds


@dataclass
class BackendMetrics:
    queue_length: int  # worker requests (choices) dispatched that have no first token yet
    in_flight: int  # worker requests dispatched and not finished
    workers: list[WorkerStatus] = field(default_factory=list)
    ready: bool = False  # every role the topology needs has at least one healthy worker (/health)
    expert_load: dict[str, dict[int, list[int]]] = field(default_factory=dict)  # role -> layer -> per expert
    migrations: MigrationStats = field(default_factory=MigrationStats)
    pool_events: dict[tuple[str, str], int] = field(
        default_factory=dict
    )  # (pool, event) -> count, 0s included
