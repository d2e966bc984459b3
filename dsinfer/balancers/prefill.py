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

Expected prefix hit. The balancer cannot see a rank's cache, so it keeps, per rank, an LRU set
of the last ``prefix_capacity`` page hashes it sent there. With ``m_r`` = the number of leading
``RouteRequest.page_hashes`` found in rank ``r``'s set (hashes are chained, so the first miss
ends the prefix; each pick adds the request's hashes to the chosen rank's set)::

    c_r = min(m_r, (L - 1) // page_size) * page_size     (the last prompt token is always computed)

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

from collections import OrderedDict
from dataclasses import dataclass, field

from dsinfer.balancers.base import Balancer, RouteRequest
from dsinfer.base.protocol import LoadReport


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
    prefix: OrderedDict[bytes, None] = field(default_factory=OrderedDict)
    total_tokens: int = 0  # new tokens ever sent here: evens out ties between idle ranks

    def pending(self) -> tuple[int, int]:
        attention = self.attention + sum(d.attention for d in self.dispatched.values())
        tokens = self.tokens + sum(d.tokens for d in self.dispatched.values())
        return attention, tokens

    def matched_pages(self, page_hashes: list[bytes]) -> int:
        count = 0
        for key in page_hashes:
            if key not in self.prefix:
                break
            count += 1
        return count


class PrefillBalancer(Balancer):
    def __init__(
        self,
        page_size: int,
        *,
        token_weight: float = 8192.0,
        hot_prefix_cap: float = 2.0,
        prefix_capacity: int = 8192,
        report_margin: float = 0.25,
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
        self.page_size = page_size
        self.token_weight = token_weight
        self.hot_prefix_cap = hot_prefix_cap
        self.prefix_capacity = prefix_capacity
        self.report_margin = report_margin
        self._ranks: dict[str, _Rank] = {}

    def _rank(self, worker: str) -> _Rank:
        rank = self._ranks.get(worker)
        if rank is None:
            rank = self._ranks[worker] = _Rank()
        return rank

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
        for name in eligible:
            pages = ranks[name].matched_pages(request.page_hashes) if load[name] <= hot else 0
            new_tokens = prompt_len - min(pages, max_cached_pages) * self.page_size
            after = load[name] + self._cost(new_tokens, prompt_len)
            scored.append((after, pending[name][1] + new_tokens, ranks[name].total_tokens, name, new_tokens))
        *_, chosen, new_tokens = min(scored)

        rank = ranks[chosen]
        rank.total_tokens += new_tokens
        rank.dispatched[request.request_id] = _Dispatch(now, new_tokens * prompt_len, new_tokens)
        self._remember(rank, request.page_hashes)
        return chosen

    def _remember(self, rank: _Rank, page_hashes: list[bytes]) -> None:
        # Newest first, so that eviction from the old end drops the deepest pages of a prefix
        # before its first ones and a truncated record still matches from the start.
        for key in reversed(page_hashes):
            rank.prefix[key] = None
            rank.prefix.move_to_end(key)
        while len(rank.prefix) > self.prefix_capacity:
            rank.prefix.popitem(last=False)

    def update(self, report: LoadReport, now: float) -> None:
        rank = self._rank(report.worker)
        if rank.incarnation is not None and rank.incarnation != report.incarnation:
            rank.dispatched.clear()
            rank.prefix.clear()
        rank.incarnation = report.incarnation
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
