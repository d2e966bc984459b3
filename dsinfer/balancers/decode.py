"""Decode load balancer: KV cache usage (core attention) and request count (dispatch) per rank.

Footprint. A request of ``L`` prompt tokens is expected to hold, at its end::

    f = ceil((L + min(max_tokens, max_tokens_cap)) / page_size)   pages

(``max_tokens_cap`` because clients often ask for far more tokens than they get.)

Per rank ``r``, from the last report (``kv_pages_used``, ``num_running + num_waiting``), the
requests this balancer dispatched to ``r`` since that report (``recent``), and every request it
dispatched to ``r`` and was not told ``finished`` about (``inflight``)::

    pages_r = max(kv_pages_used + sum(f over recent), sum(f over inflight))
    count_r = max(num_running + num_waiting + len(recent), len(inflight))

The first term is the rank's present plus what the report cannot show yet; the second is what
this balancer has committed the rank to, which counts a request's future growth from its first
step on. A dispatch is "recent" until a report arrives more than ``report_margin`` s after it
(reports lag by up to one heartbeat plus a step). A report with a new ``incarnation`` (the pool
restarted) forgets the rank's requests.

Pick. ``usage_r = (pages_r + f) / total_r`` with ``total_r`` the rank's reported
``kv_pages_total`` (else the largest any rank reported, else ``default_kv_pages``). Ranks whose
usage is within ``kv_slack`` of the least usage count as equal in KV; among them the pick is::

    argmin_r ( count_r + 1,  usage_r,  r )

Conversation affinity. A conversation's next turn re-sends the earlier turns, whose pages the rank
that decoded them may still hold in its prefix cache (then the prefill rank sends only the rest).
The balancer keeps, per rank, a record of the page hashes it sent there (``prefix_capacity``
pages, dsinfer/balancers/prefix_record.py); a leading page counts while fewer pages than the
rank's pool were sent after it. Among the ranks equal in KV whose ``count_r`` is within
``count_slack`` of the least, the one holding the longest prefix is picked (then the key above):
affinity never takes a rank out of the KV slack, nor more than ``count_slack`` requests past the
least busy.

Draining ranks are only picked when every candidate drains.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dsinfer.balancers.base import Balancer, RouteRequest
from dsinfer.balancers.prefix_record import PrefixRecord
from dsinfer.base.protocol import LoadReport


@dataclass(frozen=True)
class _Dispatch:
    at: float
    pages: int


@dataclass
class _Rank:
    incarnation: str | None = None
    pages_used: int = 0  # from the last report
    pages_total: int = 0
    count: int = 0
    draining: bool = False
    inflight: dict[str, int] = field(default_factory=dict)  # request id -> footprint pages
    inflight_pages: int = 0
    recent: dict[str, _Dispatch] = field(default_factory=dict)  # not in a report yet
    prefix: PrefixRecord = field(default_factory=lambda: PrefixRecord(0))

    def held_pages(self, page_hashes: list[bytes]) -> int:
        pool = self.pages_total or float("inf")
        return sum(1 for depth in self.prefix.leading(page_hashes) if depth < pool)

    def estimate(self) -> tuple[int, int]:
        recent_pages = sum(d.pages for d in self.recent.values())
        pages = max(self.pages_used + recent_pages, self.inflight_pages)
        count = max(self.count + len(self.recent), len(self.inflight))
        return pages, count

    def add(self, request_id: str, pages: int, now: float) -> None:
        self.discard(request_id)
        self.inflight[request_id] = pages
        self.inflight_pages += pages
        self.recent[request_id] = _Dispatch(now, pages)

    def discard(self, request_id: str) -> None:
        self.inflight_pages -= self.inflight.pop(request_id, 0)
        self.recent.pop(request_id, None)


class DecodeBalancer(Balancer):
    def __init__(
        self,
        page_size: int,
        *,
        max_tokens_cap: int = 2048,
        kv_slack: float = 0.02,
        default_kv_pages: int = 4096,
        report_margin: float = 0.25,
        count_slack: int = 2,
        prefix_capacity: int = 8192,
    ) -> None:
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        if max_tokens_cap < 0:
            raise ValueError(f"max_tokens_cap must be >= 0, got {max_tokens_cap}")
        if kv_slack < 0:
            raise ValueError(f"kv_slack must be >= 0, got {kv_slack}")
        if default_kv_pages <= 0:
            raise ValueError(f"default_kv_pages must be positive, got {default_kv_pages}")
        if report_margin < 0:
            raise ValueError(f"report_margin must be >= 0, got {report_margin}")
        if count_slack < 0 or prefix_capacity < 0:
            raise ValueError(
                f"count_slack and prefix_capacity must be >= 0, got {count_slack}, {prefix_capacity}"
            )
        self.count_slack, self.prefix_capacity = count_slack, prefix_capacity
        self.page_size = page_size
        self.max_tokens_cap = max_tokens_cap
        self.kv_slack = kv_slack
        self.default_kv_pages = default_kv_pages
        self.report_margin = report_margin
        self._ranks: dict[str, _Rank] = {}

    def footprint(self, request: RouteRequest) -> int:
        tokens = len(request.prompt_token_ids) + min(max(request.max_tokens, 0), self.max_tokens_cap)
        return -(-tokens // self.page_size)

    def _rank(self, worker: str) -> _Rank:
        rank = self._ranks.get(worker)
        if rank is None:
            rank = self._ranks[worker] = _Rank(prefix=PrefixRecord(self.prefix_capacity))
        return rank

    def pick(self, request: RouteRequest, candidates: list[str], now: float) -> str:
        if not candidates:
            raise ValueError(f"no decode candidates for request {request.request_id}")
        ranks = {name: self._rank(name) for name in candidates}
        eligible = [name for name, rank in ranks.items() if not rank.draining] or list(ranks)
        pages = self.footprint(request)
        fallback_total = (
            max((r.pages_total for r in self._ranks.values()), default=0) or self.default_kv_pages
        )

        scored: list[tuple[int, float, str]] = []
        for name in eligible:
            rank = ranks[name]
            used, count = rank.estimate()
            scored.append((count + 1, (used + pages) / (rank.pages_total or fallback_total), name))
        least_usage = min(usage for _, usage, _ in scored)
        equal = [s for s in scored if s[1] <= least_usage + self.kv_slack]
        least_count = min(count for count, _, _ in equal)
        near = [s for s in equal if s[0] <= least_count + self.count_slack]
        held = {name: ranks[name].held_pages(request.page_hashes) for _, _, name in near}
        if max(held.values()) > 0:
            _, _, _, chosen = min((-held[s[2]], *s) for s in near)
        else:
            _, _, chosen = min(equal)
        ranks[chosen].add(request.request_id, pages, now)
        ranks[chosen].prefix.remember(request.page_hashes)
        return chosen

    def update(self, report: LoadReport, now: float) -> None:
        rank = self._rank(report.worker)
        if rank.incarnation is not None and rank.incarnation != report.incarnation:
            rank.inflight.clear()
            rank.inflight_pages = 0
            rank.recent.clear()
            rank.prefix.clear()
        rank.incarnation = report.incarnation
        rank.pages_used = report.kv_pages_used
        rank.pages_total = report.kv_pages_total
        rank.count = report.num_running + report.num_waiting
        rank.draining = report.draining
        cutoff = now - self.report_margin
        rank.recent = {rid: d for rid, d in rank.recent.items() if d.at >= cutoff}

    def finished(self, request_id: str, worker: str) -> None:
        rank = self._ranks.get(worker)
        if rank is not None:
            rank.discard(request_id)

    def remove(self, worker: str) -> None:
        self._ranks.pop(worker, None)
