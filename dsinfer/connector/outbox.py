"""What a connector side sends through (the rank's channel) and what it counts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import msgspec


class Outbox(Protocol):
    def send_gateway(self, message: msgspec.Struct) -> None: ...

    def send_peer(self, inbox: str, message: msgspec.Struct) -> None: ...


class Fail(Protocol):
    def __call__(self, request_id: str, error: str, retryable: bool = False) -> None:
        """End the request's current attempt with a one-line ``error``; ``retryable``: nothing of
        it reached the client and its failure was the transfer's, so the gateway dispatches it
        again (another pair of ranks) instead of ending it."""


@dataclass
class TransferCounters:
    """KV transfers of this rank since start (a LoadReport carries them)."""

    bytes: int = 0
    seconds: float = 0.0  # summed wall time from first write to completion
    count: int = 0
    bytes_by_group: dict[str, int] = field(default_factory=dict)  # the same bytes by cache group

    def add_groups(self, groups: dict[str, int]) -> None:
        for group, n in groups.items():
            self.bytes_by_group[group] = self.bytes_by_group.get(group, 0) + n
