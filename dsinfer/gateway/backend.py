"""What the HTTP layer needs from whatever runs the requests (the router over worker pools).

``submit`` returns at once with a ``JobStream`` or raises: ``Overloaded`` (-> 429 with
Retry-After), ``Unavailable`` (-> 503: no healthy worker of a needed role). Iterating the stream
yields ``(choice, TokenDelta)`` pairs, every choice ending with one delta that has
``finish_reason`` or ``error`` set; the stream ends after the last choice ended. ``abort``
(idempotent) ends every unfinished choice with finish_reason "abort" and frees what the
workers hold; the HTTP layer calls it when the client disconnects.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from dsinfer.base.protocol import TokenDelta
from dsinfer.base.sampling_params import SamplingParams


class Overloaded(Exception):
    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Unavailable(Exception):
    pass


@dataclass
class Job:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # n may be > 1; seed None = the router draws one for all choices
    timeout: float | None = None  # seconds from submission; None = the server's default
    arrival_time: float = 0.0  # time.monotonic() at the HTTP layer
    metadata: dict[str, str] = field(default_factory=dict)


class JobStream(Protocol):
    def __aiter__(self) -> AsyncIterator[tuple[int, TokenDelta]]: ...

    async def abort(self) -> None: ...


class Backend(Protocol):
    def submit(self, job: Job) -> JobStream: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def metrics_snapshot(self) -> BackendMetrics: ...


@dataclass
class WorkerMetrics:
    worker: str
    role: str
    healthy: bool
    num_running: int
    num_waiting: int
    kv_pages_used: int
    kv_pages_total: int
    prompt_tokens: int
    memory_hit_tokens: int
    disk_hit_tokens: int
    transfer_bytes: int
    transfer_seconds: float
    transfers: int


@dataclass
class BackendMetrics:
    queue_length: int  # jobs accepted but not yet dispatched to a worker
    in_flight: int  # worker requests dispatched and not finished
    workers: list[WorkerMetrics] = field(default_factory=list)
    ready: bool = False  # every role the topology needs has at least one healthy worker (/health)
    expert_load: dict[str, dict[int, list[int]]] = field(default_factory=dict)  # role -> layer -> per expert
