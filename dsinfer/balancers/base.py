"""Load balancer interface (gateway side; pure policies over the workers' load reports).

A balancer is asked once per worker request and answers a worker name among ``candidates``
(healthy ranks of one role, of every pool). It learns the load from ``LoadReport``s (``update``)
and from its own decisions (``pick`` may record what it dispatched, since reports lag), and
forgets a worker on ``remove``. No I/O, no clock of its own: the caller passes ``now``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from dsinfer.base.protocol import LoadReport


@dataclass(frozen=True)
class RouteRequest:
    request_id: str
    prompt_token_ids: list[int]
    page_hashes: list[bytes]  # dsinfer.base.hashing.page_hashes of the prompt (full pages)
    max_tokens: int


class Balancer(ABC):
    @abstractmethod
    def pick(self, request: RouteRequest, candidates: list[str], now: float) -> str: ...

    @abstractmethod
    def update(self, report: LoadReport, now: float) -> None: ...

    def finished(self, request_id: str, worker: str) -> None:  # noqa: B027 - optional hook
        """The request left ``worker`` (finished, aborted or failed)."""

    def remove(self, worker: str) -> None:  # noqa: B027 - optional hook
        """``worker`` left rotation (its pool died or drains)."""
