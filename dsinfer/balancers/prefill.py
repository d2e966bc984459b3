"""Prefill load balancer: core-attention compute and input tokens, with prefix affinity.

Units. A request of ``L`` prompt tokens of which ``c`` are already cached on a rank computes
``n = L - c`` new tokens; its core-attention load is ``n * L`` (the unit of
``LoadReport.pending_attention_load``) and its dispatched input is ``n`` tokens. Both are folded
into one cost in attention units::

    cost(n, L) = n * L + token_weight * n

``token_weight`` is the context length at which a new token spends as long in core attention as
in the rest of the forward (GEMMs, expert dispatch and combine). For DeepSeek-V3 it is about 7k
to 15k: 2 x 37B active-parameter FLOPs per token in FP8 (twice the BF16 rate) against 61 layers x
128 heads x 2 x (192 + 128) = 5 MFLOP of BF16 MLA per query-key pair, with up to half of the
``n * L`` pairs masked. The default is 8192; ``token_weight = 0`` balances attention alone.

Expected prefix hit, by tier. The balancer cannot see a rank's caches, so it keeps records of
the page hashes it sent (dsinfer/balancers/prefix_record.py): one per rank (the last
``prefix_capacity`` pages), and one per disk tier (``LoadReport.kv_disk_tier_id``: every rank
reporting the same id shares one directory, the cluster-wide tier), each pick adding the
request's hashes to both. A leading page (hashes are chained, so the first miss ends the prefix)
is placed in a tier by how many pages were sent to the rank since it (its depth): in the rank's
device pages while the depth is below their number (``kv_pages_total``; all of them before the
first report), else in its host tier while below that plus the host tier's capacity, else on
disk while its tier's record is no deeper than the disk's capacity. A hit from tier ``t`` still
costs ``tier_cost[t]`` of the page's compute (the load), so with ``h_r`` the sum over the leading
hits of ``1 - tier_cost``, at most ``(L - 1) // page_size`` of them (the last prompt token is
always computed)::

    c_r = round(h_r * page_size)

Load. ``load_r`` = the last report's ``pending_attention_load + token_weight *
pending_prefill_tokens`` plus the cost of every request dispatched to ``r`` since that report
and not finished. Reports lag (one every 0.5 s, and a rank only sees what it drained before its
step), so which dispatches a report covers is unknown: a dispatch is assumed covered by a report
arriving more than ``report_margin`` seconds after it and is then dropped (a dispatch newer than
that is counted twice at worst until the next report). ``finished`` drops it at once.

Pick. A rank is *hot* when ``load_r > hot_prefix_cap * min_s load_s`` over the candidates; a hot
rank's hit is ignored (``c_r = 0``), so a popular prefix cannot pile work onto one rank while
others are much less loaded (in particular, while one is idle a hit never draws a request onto a
busy rank). The pick is::

    argmin_r ( load_r + cost(L - c_r, L),  tokens_r + L - c_r,  r )

where ``tokens_r`` is the input-token part of ``load_r``: the least estimated load after adding
the request (its completion time under FIFO at a fixed rate), then fewer input tokens, then the
name. Draining ranks are only picked when every candidate drains. A report with a new
``incarnation`` (the pool restarted) forgets the rank's prefix record and dispatches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dsinfer.balancers.base import Balancer, RouteRequest
from dsinfer.balancers.prefix_record import PrefixRecord
from dsinfer.base.protocol import LoadReport

# share of a page's prefill a hit from each tier still costs: copying it into the pool (a page
# of DeepSeek-V3 is ~4.5 MiB: 0.2 ms over PCIe from pinned host memory, 1-2 ms from NVMe, against
# ~6 ms to prefill its 64 tokens on an H800)
TIER_COSTS = {"device": 0.0, "host": 0.05, "disk": 0.25}
DISK_RECORD_CAP = 65536  # pages a disk tier's record keeps at most


@dataclass(frozen=True)
class _Dispatch:
    at: float
    attention: int
    tokens: int


@dataclass
class _Rank:
    incarnation: str | None = None
    attention: int = 0  # from the last report
    tokens: int = 0
    draining: bool = False
    dispatched: dict[str, _Dispatch] = field(default_factory=dict)
    prefix: PrefixRecord = field(default_factory=lambda: PrefixRecord(0))
    total_tokens: int = 0  # new tokens ever sent here: evens out ties between idle ranks
    device_pages: float = float("inf")  # from the reports: the pool's pages, the host tier's
    host_pages: float = 0.0
    disk_tier: str = ""  # the id of the disk tier it reads and writes ("" without one)

    def pending(self) -> tuple[int, int]:
        attention = self.attention + sum(d.attention for d in self.dispatched.values())
        tokens = self.tokens + sum(d.tokens for d in self.dispatched.values())
        return attention, tokens

    def tier_at(self, depth: int) -> str | None:
        if depth < self.device_pages:
            return "device"
        return "host" if depth < self.device_pages + self.host_pages else None


class PrefillBalancer(Balancer):
    def __init__(
        self,
        page_size: int,
        *,
        token_weight: float = 8192.0,
        hot_prefix_cap: float = 2.0,
        prefix_capacity: int = 8192,
        report_margin: float = 0.25,
        tier_cost: dict[str, float] | None = None,
    ) -> None:
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        if token_weight < 0:
            raise ValueError(f"token_weight must be >= 0, got {token_weight}")
        if hot_prefix_cap < 1.0:
            raise ValueError(f"hot_prefix_cap must be >= 1, got {hot_prefix_cap}")
        if prefix_capacity < 0:
            raise ValueError(f"prefix_capacity must be >= 0, got {prefix_capacity}")
        if report_margin < 0:
            raise ValueError(f"report_margin must be >= 0, got {report_margin}")
        self.tier_cost = {**TIER_COSTS, **(tier_cost or {})}
        if set(self.tier_cost) != set(TIER_COSTS) or not all(0 <= c <= 1 for c in self.tier_cost.values()):
            raise ValueError(f"tier_cost takes {', '.join(TIER_COSTS)}, each in [0, 1]; got {tier_cost}")
        self.page_size = page_size
        self.token_weight = token_weight
        self.hot_prefix_cap = hot_prefix_cap
        self.prefix_capacity = prefix_capacity
        self.report_margin = report_margin
        self._ranks: dict[str, _Rank] = {}
        self._disks: dict[str, tuple[PrefixRecord, float]] = {}  # tier id -> record, capacity in pages

    def _rank(self, worker: str) -> _Rank:
        rank = self._ranks.get(worker)
        if rank is None:
            rank = self._ranks[worker] = _Rank(prefix=PrefixRecord(self.prefix_capacity))
        return rank

    def _saved_pages(self, rank: _Rank, page_hashes: list[bytes]) -> float:
        """Pages of compute the rank's leading cached pages save, each less its tier's load cost."""
        record, disk_pages = self._disks.get(rank.disk_tier, (None, 0.0))
        saved = 0.0
        for key in page_hashes:
            depth = rank.prefix.depth(key)
            tier = rank.tier_at(depth) if depth is not None else None
            if tier is None and record is not None and (depth := record.depth(key)) is not None:
                tier = "disk" if depth < disk_pages else None
            if tier is None:
                break
            saved += 1.0 - self.tier_cost[tier]
        return saved

    def _cost(self, new_tokens: int, prompt_len: int) -> float:
        return new_tokens * prompt_len + self.token_weight * new_tokens

    def pick(self, request: RouteRequest, candidates: list[str], now: float) -> str:
        if not candidates:
            raise ValueError(f"no prefill candidates for request {request.request_id}")
        ranks = {name: self._rank(name) for name in candidates}
        eligible = [name for name, rank in ranks.items() if not rank.draining] or list(ranks)
        prompt_len = len(request.prompt_token_ids)
        max_cached_pages = max(prompt_len - 1, 0) // self.page_size

        pending = {name: ranks[name].pending() for name in eligible}
        load = {name: a + self.token_weight * t for name, (a, t) in pending.items()}
        hot = self.hot_prefix_cap * min(load.values())
        scored: list[tuple[float, int, int, str, int]] = []
        leading = request.page_hashes[:max_cached_pages]
        for name in eligible:
            saved = self._saved_pages(ranks[name], leading) if load[name] <= hot else 0.0
            new_tokens = prompt_len - round(saved * self.page_size)
            after = load[name] + self._cost(new_tokens, prompt_len)
            scored.append((after, pending[name][1] + new_tokens, ranks[name].total_tokens, name, new_tokens))
        *_, chosen, new_tokens = min(scored)

        rank = ranks[chosen]
        rank.total_tokens += new_tokens
        rank.dispatched[request.request_id] = _Dispatch(now, new_tokens * prompt_len, new_tokens)
        rank.prefix.remember(request.page_hashes)
        if rank.disk_tier in self._disks:
            self._disks[rank.disk_tier][0].remember(request.page_hashes)
        return chosen

    def update(self, report: LoadReport, now: float) -> None:
        rank = self._rank(report.worker)
        if rank.incarnation is not None and rank.incarnation != report.incarnation:
            rank.dispatched.clear()
            rank.prefix.clear()
        rank.incarnation = report.incarnation
        host, disk = report.kv_tiers.get("host", {}), report.kv_tiers.get("disk", {})
        rank.device_pages = report.kv_pages_total or float("inf")
        rank.host_pages = host.get("capacity_pages", 0.0)
        rank.disk_tier = report.kv_disk_tier_id
        if rank.disk_tier and rank.disk_tier not in self._disks:
            capacity = disk.get("capacity_pages", 0.0)
            self._disks[rank.disk_tier] = (PrefixRecord(int(min(capacity, DISK_RECORD_CAP))), capacity)
        rank.attention = report.pending_attention_load
        rank.tokens = report.pending_prefill_tokens
        rank.draining = report.draining
        cutoff = now - self.report_margin
        rank.dispatched = {rid: d for rid, d in rank.dispatched.items() if d.at >= cutoff}

    def finished(self, request_id: str, worker: str) -> None:
        rank = self._ranks.get(worker)
        if rank is not None:
            rank.dispatched.pop(request_id, None)

    def remove(self, worker: str) -> None:
        self._ranks.pop(worker, None)
