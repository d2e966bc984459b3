"""How long the queue would keep a new request waiting, from the rate at which queued choices
got their first token lately.

Admission has two bounds (dsinfer/gateway/request_run.py ``RequestRun.start``): the count,
``--max-queued-requests``, and this one: while the queue's expected wait (queued choices over the
recent start rate) exceeds ``MAX_WAIT_SHARE`` of ``--request-timeout``, a new request gets 429
with Retry-After, so that work accepted can still finish within its own deadline. The rate counts
only the time since the queue was last seen empty (an idle stretch is not slowness), and with too
few starts to judge (an idle or cold server, the first moments of a burst) only the count applies.
"""

from __future__ import annotations

import bisect
from collections import deque

WINDOW = 30.0  # seconds of first tokens the rate is taken over
MIN_STARTS = 8  # fewer starts in the window: no estimate
MAX_WAIT_SHARE = 0.5  # of the request timeout a new request may expect to spend queued


class QueueDrain:
    def __init__(self, window: float = WINDOW, min_starts: int = MIN_STARTS) -> None:
        self.window, self.min_starts = window, min_starts
        self._starts: deque[float] = deque()  # time.monotonic() of recent first tokens
        self._idle_at = float("-inf")  # when the queue was last seen empty

    def started(self, now: float) -> None:
        """A queued choice got its first token (or ended without one)."""
        self._starts.append(now)
        self._trim(now)

    def rate(self, now: float) -> float | None:
        """Choices leaving the queue per second since the window's start or the queue was last
        empty, whichever is later; None with too few."""
        self._trim(now)
        since = max(self._idle_at, self._starts[0] if self._starts else now)
        count = len(self._starts) - bisect.bisect_left(self._starts, since)
        if count < self.min_starts:
            return None
        return count / max(now - since, 1e-3)

    def expected_wait(self, queued: int, now: float) -> float | None:
        rate = self.rate(now)
        return None if rate is None else queued / rate

    def refusal(self, queued: int, request_timeout: float, now: float) -> tuple[str, float] | None:
        """(why, Retry-After seconds) when the queue would hold a new request past its share of
        the timeout, else None."""
        if queued == 0:
            self._idle_at = now
        wait = self.expected_wait(queued, now)
        limit = request_timeout * MAX_WAIT_SHARE
        if wait is None or wait <= limit:
            return None
        why = (
            f"{queued} requests are queued and the pools start about {queued / wait:.1f} per second: "
            f"a new one would wait ~{wait:.0f} s for its first token, more than half of its "
            f"{request_timeout:g} s deadline (--request-timeout)"
        )
        return why, wait - limit

    def _trim(self, now: float) -> None:
        while self._starts and now - self._starts[0] > self.window:
            self._starts.popleft()
