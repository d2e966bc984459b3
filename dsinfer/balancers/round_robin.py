"""Round-robin baseline: ignores load and prefixes; the comparison point for the load balancers.

Each pick takes the first candidate name (in sorted order) after the previous pick's name,
wrapping around, so the rotation stays fair when workers join or leave between picks.
"""

from __future__ import annotations

from dsinfer.balancers.base import Balancer, RouteRequest
from dsinfer.base.protocol import LoadReport


class RoundRobinBalancer(Balancer):
    def __init__(self) -> None:
        self._last: str | None = None

    def pick(self, request: RouteRequest, candidates: list[str], now: float) -> str:
        if not candidates:
            raise ValueError(f"no candidates for request {request.request_id}")
        names = sorted(set(candidates))
        last = self._last
        chosen = next((name for name in names if last is not None and name > last), names[0])
        self._last = chosen
        return chosen

    def update(self, report: LoadReport, now: float) -> None:
        pass
