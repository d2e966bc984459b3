"""What a connector side sends through (the rank's channel) and what it counts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import msgspec


class Outbox(Protocol):
    def send_gateway(self, message: msgspec.Struct) -> None: ...

    def send_peer(self, inbox: str, message: msgspec.Struct) -> None: ...


Fail = Callable[[str, str], None]  # (request_id, one-line reason): the request ends with that error


@dataclass
class TransferCounters:
    """KV transfers of this rank since start (a LoadReport carries them)."""

    bytes: int = 0
    seconds: float = 0.0  # summed wall time from first write to completion
    count: int = 0
