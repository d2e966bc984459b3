"""Gateway load balancers: a simulated skewed workload against round robin, prefix affinity and
its hot-spot cap, report reconciliation, finished/remove bookkeeping, determinism, registry."""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import pytest

from dsinfer.balancers import (
    Balancer,
    DecodeBalancer,
    PrefillBalancer,
    RoundRobinBalancer,
    RouteRequest,
    make_balancer,
)
from dsinfer.base.hashing import model_root, page_hashes
from dsinfer.base.protocol import HEARTBEAT_INTERVAL, LoadReport

PS = 64
ROOT = model_root("test-balancers", str(PS))


def _request(rid: str, tokens: list[int], max_tokens: int = 128) -> RouteRequest:
    return RouteRequest(rid, tokens, page_hashes(tokens, PS, ROOT), max_tokens)


def _workers(n: int, role: str = "prefill") -> list[str]:
    return [f"{role}/0/{i}" for i in range(n)]


# Skewed workload -------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Arrival:
    at: float
    request: RouteRequest
    output_len: int  # decode only: tokens actually generated


NUM_PREFIXES = 12


def _workload(seed: int, count: int, rate: float, shared_prefixes: bool) -> list[_Arrival]:
    """Poisson arrivals; log-normal prompt lengths (median 1,100 tokens, 1% over 11,000); with
    ``shared_prefixes``, 60% of the prompts start with one of NUM_PREFIXES shared prefixes of 8
    to 32 pages, the i-th drawn with weight 1 / (i + 1); log-normal output lengths (median 245)
    capped by max_tokens."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(50_000, size=rng.integers(8, 33) * PS) for _ in range(NUM_PREFIXES)]
    weights = 1 / np.arange(1, NUM_PREFIXES + 1)
    arrivals = []
    now = 0.0
    for i in range(count):
        now += rng.exponential(1 / rate)
        suffix = rng.integers(50_000, size=min(16_000, int(rng.lognormal(7.0, 1.0))))
        if shared_prefixes and rng.random() < 0.6:
            suffix = np.concatenate([prefixes[rng.choice(NUM_PREFIXES, p=weights / weights.sum())], suffix])
        max_tokens = int(rng.choice((512, 2048, 8192)))
        output_len = min(max_tokens, int(rng.lognormal(5.5, 1.0)))
        arrivals.append(_Arrival(now, _request(f"r{i}", suffix.tolist(), max_tokens), output_len))
    return arrivals


# Service models and the simulation driver ----------------------------------------------------
K_TRUE = 8192  # the prefill cost model: work = new + new x L / K_TRUE
PREFILL_RATE = 10_000.0  # prefill work units per second per rank
RANK_CACHE_PAGES = 128  # each prefill rank's real prefix cache (LRU of page hashes)
DECODE_RATE = 50.0  # tokens per second per decoding request
DECODE_KV_PAGES = 4096
WARMUP = 2.0  # seconds of simulated time not sampled


class _SimRank(Protocol):
    name: str

    def admit(self, arrival: _Arrival) -> None: ...

    def advance(self, dt: float) -> list[str]:
        """Run ``dt`` seconds; the ids of the requests that ended."""

    def report(self) -> LoadReport: ...

    def load(self) -> tuple[float, ...]: ...


def _simulate(
    balancer: Balancer, arrivals: list[_Arrival], ranks: Sequence[_SimRank], dt: float
) -> list[float]:
    """Drive ``balancer`` over ``arrivals``; staggered heartbeats every HEARTBEAT_INTERVAL s. Returns,
    per load metric, the time-weighted imbalance over the ranks: sum over ticks of the max over the
    sum over ticks of the mean, sampled from WARMUP to the last arrival."""
    names = [r.name for r in ranks]
    by_name = {r.name: r for r in ranks}
    pending = deque(arrivals)
    every = round(HEARTBEAT_INTERVAL / dt)
    peak: list[float] = []
    mean: list[float] = []
    tick = 0
    while pending:
        now = tick * dt
        while pending and pending[0].at < now + dt:
            arrival = pending.popleft()
            by_name[balancer.pick(arrival.request, names, arrival.at)].admit(arrival)
        for i, rank in enumerate(ranks):
            for request_id in rank.advance(dt):
                balancer.finished(request_id, rank.name)
            if (tick + i * every // len(ranks)) % every == 0:
                balancer.update(rank.report(), now + dt)
        if now >= WARMUP:
            loads = list(zip(*(rank.load() for rank in ranks), strict=True))
            peak = [a + max(m) for a, m in zip(peak or [0.0] * len(loads), loads, strict=True)]
            mean = [a + sum(m) / len(m) for a, m in zip(mean or [0.0] * len(loads), loads, strict=True)]
        tick += 1
    return [p / m for p, m in zip(peak, mean, strict=True)]


class _PrefillRank:
    """FIFO at PREFILL_RATE work units/s; a request's prefix is matched against the rank's cache
    when it starts, and its pages enter the cache when it ends. Load = work done in the tick."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.queue: deque[RouteRequest] = deque()
        self.left = 0.0  # work left of the head; 0 = not started
        self.done = 0.0
        self.hit_tokens = 0
        self.cache: OrderedDict[bytes, None] = OrderedDict()

    def cached_tokens(self, request: RouteRequest) -> int:
        hit = 0
        for key in request.page_hashes[: (len(request.prompt_token_ids) - 1) // PS]:
            if key not in self.cache:
                break
            hit += 1
        return hit * PS

    def work(self, request: RouteRequest) -> float:
        length = len(request.prompt_token_ids)
        new = length - self.cached_tokens(request)
        return new + new * length / K_TRUE

    def admit(self, arrival: _Arrival) -> None:
        self.queue.append(arrival.request)

    def advance(self, dt: float) -> list[str]:
        budget = PREFILL_RATE * dt
        ended = []
        while budget > 0 and self.queue:
            head = self.queue[0]
            if self.left == 0.0:
                self.left = self.work(head)
                self.hit_tokens += self.cached_tokens(head)
            step = min(budget, self.left)
            self.left -= step
            budget -= step
            if self.left <= 1e-9:
                self.left = 0.0
                for key in reversed(head.page_hashes):
                    self.cache[key] = None
                    self.cache.move_to_end(key)
                while len(self.cache) > RANK_CACHE_PAGES:
                    self.cache.popitem(last=False)
                ended.append(self.queue.popleft().request_id)
        self.done = PREFILL_RATE * dt - budget
        return ended

    def report(self) -> LoadReport:
        attention = tokens = 0
        for i, request in enumerate(self.queue):
            length = len(request.prompt_token_ids)
            new = length - self.cached_tokens(request)
            if i == 0 and self.left > 0:  # the share of the head not computed yet
                new = math.ceil(new * self.left / self.work(request))
            attention += new * length
            tokens += new
        return LoadReport(
            worker=self.name, incarnation="1", pending_attention_load=attention, pending_prefill_tokens=tokens
        )

    def load(self) -> tuple[float, ...]:
        return (self.done,)


class _DecodeRank:
    """Every request gains DECODE_RATE tokens/s until its output length. Loads = KV pages used
    (sum of ceil((prompt + generated) / PS)) and the number of requests."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.running: dict[str, list] = {}  # id -> [prompt length, output length, generated]

    def admit(self, arrival: _Arrival) -> None:
        request = arrival.request
        self.running[request.request_id] = [len(request.prompt_token_ids), arrival.output_len, 0.0]

    def advance(self, dt: float) -> list[str]:
        for state in self.running.values():
            state[2] = min(state[1], state[2] + DECODE_RATE * dt)
        ended = [rid for rid, state in self.running.items() if state[2] >= state[1]]
        for rid in ended:
            del self.running[rid]
        return ended

    def pages(self) -> int:
        return sum(
            math.ceil((prompt + int(generated)) / PS) for prompt, _, generated in self.running.values()
        )

    def report(self) -> LoadReport:
        return LoadReport(
            worker=self.name,
            incarnation="1",
            num_running=len(self.running),
            kv_pages_used=self.pages(),
            kv_pages_total=DECODE_KV_PAGES,
        )

    def load(self) -> tuple[float, ...]:
        return (self.pages(), len(self.running))


# Skewed workload against round robin -----------------------------------------------------------
SEEDS = (0, 1, 2)


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_prefill_balancer_beats_round_robin(num_ranks: int) -> None:
    """Summed over SEEDS at about 95% utilization: the per-tick work is more even across ranks
    (lockstep steps waste less) and more prompt tokens hit a rank's prefix cache."""
    imbalance = {"load": 0.0, "round_robin": 0.0}
    hits = {"load": 0, "round_robin": 0}
    for seed in SEEDS:
        arrivals = _workload(seed, count=120 * num_ranks, rate=3.0 * num_ranks, shared_prefixes=True)
        for name, balancer in [
            ("load", PrefillBalancer(PS, prefix_capacity=RANK_CACHE_PAGES)),
            ("round_robin", RoundRobinBalancer()),
        ]:
            ranks = [_PrefillRank(worker) for worker in _workers(num_ranks)]
            imbalance[name] += _simulate(balancer, arrivals, ranks, dt=0.01)[0]
            hits[name] += sum(rank.hit_tokens for rank in ranks)
    assert imbalance["load"] < imbalance["round_robin"], imbalance
    assert hits["load"] > hits["round_robin"], hits


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_decode_balancer_beats_round_robin(num_ranks: int) -> None:
    """Summed over SEEDS: KV usage is more even across ranks, the request count about as even."""
    kv = {"load": 0.0, "round_robin": 0.0}
    count = {"load": 0.0, "round_robin": 0.0}
    for seed in SEEDS:
        arrivals = _workload(seed, count=150 * num_ranks, rate=4.0 * num_ranks, shared_prefixes=False)
        for name, balancer in [("load", DecodeBalancer(PS)), ("round_robin", RoundRobinBalancer())]:
            ranks = [_DecodeRank(worker) for worker in _workers(num_ranks, "decode")]
            kv_imbalance, count_imbalance = _simulate(balancer, arrivals, ranks, dt=0.05)
            kv[name] += kv_imbalance
            count[name] += count_imbalance
    assert kv["load"] < kv["round_robin"], kv
    assert count["load"] < count["round_robin"] * 1.05, count


# Prefill policy ---------------------------------------------------------------------------------
def _prefill_report(
    worker: str, tokens: int, incarnation: str = "1", attention: int | None = None
) -> LoadReport:
    """A prefill rank with ``tokens`` pending prompt tokens (of 1,000-token prompts by default)."""
    return LoadReport(
        worker=worker,
        incarnation=incarnation,
        pending_prefill_tokens=tokens,
        pending_attention_load=tokens * 1000 if attention is None else attention,
    )


PREFIX = list(range(1000, 1000 + 32 * PS))  # 32 pages


def _with_prefix(rid: str, salt: int) -> RouteRequest:
    return _request(rid, PREFIX + [salt] * PS)


def test_prefix_affinity_and_hot_prefix_cap() -> None:
    workers = _workers(4)
    balancer = PrefillBalancer(PS, hot_prefix_cap=2.0)
    for worker, tokens in zip(workers, (1500, 1200, 1000, 1300), strict=True):
        balancer.update(_prefill_report(worker, tokens), now=0.0)
    assert balancer.pick(_with_prefix("a", 1), workers, now=0.0) == workers[2]  # least loaded
    balancer.finished("a", workers[2])

    # the prefix's rank now has 1.5x the least load: the hit still wins
    for worker, tokens in zip(workers, (1000, 1200, 1500, 1300), strict=True):
        balancer.update(_prefill_report(worker, tokens), now=1.0)
    assert balancer.pick(_with_prefix("b", 2), workers, now=1.0) == workers[2]
    assert balancer.pick(_request("c", [7] * (34 * PS)), workers, now=1.0) == workers[0]  # no prefix

    # 2.5x the least load: over the cap, so the request goes where it would without the prefix
    for worker, tokens in zip(workers, (1000, 1200, 2500, 1300), strict=True):
        balancer.update(_prefill_report(worker, tokens), now=2.0)
    assert balancer.pick(_with_prefix("d", 3), workers, now=2.0) == workers[0]

    # without the cap, the hit's saving would outweigh the same load
    uncapped = PrefillBalancer(PS, hot_prefix_cap=1e9)
    uncapped.pick(_with_prefix("a", 1), [workers[2]], now=0.0)
    for worker, tokens in zip(workers, (1000, 1200, 2500, 1300), strict=True):
        uncapped.update(_prefill_report(worker, tokens), now=2.0)
    assert uncapped.pick(_with_prefix("d", 3), workers, now=2.0) == workers[2]


def test_longest_prefix_wins_and_record_is_bounded() -> None:
    workers = _workers(2)
    balancer = PrefillBalancer(PS, prefix_capacity=40)
    balancer.pick(_request("short", PREFIX[: 8 * PS] + [1] * PS), [workers[0]], now=0.0)
    balancer.pick(_request("long", PREFIX[: 24 * PS] + [2] * PS), [workers[1]], now=0.0)
    balancer.finished("short", workers[0])
    balancer.finished("long", workers[1])
    assert balancer.pick(_with_prefix("x", 3), workers, now=0.0) == workers[1]
    balancer.finished("x", workers[1])

    # 40 pages of unrelated prompts on rank 1 push the prefix out of its record (deepest first)
    balancer.pick(_request("other", [9] * (40 * PS + 1)), [workers[1]], now=0.0)
    balancer.finished("other", workers[1])
    assert balancer.pick(_with_prefix("y", 4), workers, now=0.0) == workers[0]


def test_cached_prefix_never_covers_the_last_token() -> None:
    balancer = PrefillBalancer(PS, token_weight=0.0)
    workers = _workers(2)
    prompt = PREFIX[: 4 * PS]  # exactly 4 full pages
    balancer.pick(_request("a", prompt), [workers[0]], now=0.0)
    balancer.update(_prefill_report(workers[0], 0), now=1.0)
    balancer.update(_prefill_report(workers[1], 0), now=1.0)
    assert balancer.pick(_request("b", prompt), workers, now=1.0) == workers[0]
    # 3 pages cached: 64 new tokens x 256 context are pending on rank 0
    balancer.update(_prefill_report(workers[1], 0, attention=PS * 4 * PS - 1), now=1.0)
    assert balancer.pick(_request("c", [5] * 10), workers, now=1.0) == workers[1]


def test_prefill_reports_reconcile_dispatches() -> None:
    workers = _workers(2)
    balancer = PrefillBalancer(PS, report_margin=0.25)
    for worker in workers:
        balancer.update(_prefill_report(worker, 0), now=0.0)
    big = _request("big", [1] * 8000)
    assert balancer.pick(big, workers, now=1.0) == workers[0]  # tie: by name
    assert balancer.pick(_request("s1", [2] * 100), workers, now=1.1) == workers[1]
    # a report 0.2 s after the dispatch may predate it: "big" is still counted
    balancer.update(_prefill_report(workers[0], 0), now=1.2)
    assert balancer.pick(_request("s2", [3] * 100), workers, now=1.3) == workers[1]
    # a report more than report_margin after it covers it
    balancer.update(_prefill_report(workers[0], 0), now=1.5)
    assert balancer.pick(_request("s3", [4] * 100), workers, now=1.6) == workers[0]
    # finished() drops a dispatch at once
    for worker in workers:
        balancer.update(_prefill_report(worker, 0), now=2.0)
    # both idle: the rank that was sent fewer tokens so far takes it
    assert balancer.pick(_request("s4", [5] * 8000), workers, now=2.1) == workers[1]
    assert balancer.pick(_request("s5", [6] * 100), workers, now=2.1) == workers[0]
    balancer.finished("s4", workers[1])
    balancer.finished("s4", "prefill/9/9")  # unknown worker: ignored
    assert balancer.pick(_request("s6", [7] * 100), workers, now=2.1) == workers[1]


def test_prefill_new_incarnation_and_remove_forget_the_prefix() -> None:
    workers = _workers(2)
    for forget in ("incarnation", "remove"):
        balancer = PrefillBalancer(PS)
        balancer.update(_prefill_report(workers[1], 0), now=0.0)
        balancer.pick(_with_prefix("a", 1), [workers[1]], now=0.0)
        balancer.finished("a", workers[1])
        assert balancer.pick(_with_prefix("b", 2), workers, now=0.0) == workers[1]
        balancer.finished("b", workers[1])
        if forget == "incarnation":
            balancer.update(_prefill_report(workers[1], 0, incarnation="2"), now=1.0)
        else:
            balancer.remove(workers[1])
            balancer.remove("prefill/9/9")  # unknown: ignored
        assert balancer.pick(_with_prefix("c", 3), workers, now=1.0) == workers[0], forget


def test_prefill_remove_forgets_dispatched_load() -> None:
    workers = _workers(2)
    balancer = PrefillBalancer(PS)
    balancer.pick(_request("big", [1] * 8000), [workers[0]], now=0.0)
    assert balancer.pick(_request("a", [2] * 100), workers, now=0.0) == workers[1]
    balancer.remove(workers[0])
    assert balancer.pick(_request("b", [3] * 100), workers, now=0.0) == workers[0]


# Decode policy ----------------------------------------------------------------------------------
def _decode_report(
    worker: str, used: int, running: int, total: int = 1000, incarnation: str = "1"
) -> LoadReport:
    return LoadReport(
        worker=worker,
        incarnation=incarnation,
        kv_pages_used=used,
        kv_pages_total=total,
        num_running=running,
    )


def test_decode_footprint_caps_max_tokens() -> None:
    balancer = DecodeBalancer(PS, max_tokens_cap=1000)
    assert balancer.footprint(_request("a", [1] * 100, max_tokens=28)) == 2
    assert balancer.footprint(_request("b", [1] * 100, max_tokens=10**6)) == math.ceil(1100 / PS)
    assert balancer.footprint(_request("c", [1] * 64, max_tokens=0)) == 1


def test_decode_prefers_kv_then_request_count() -> None:
    workers = _workers(3, "decode")
    balancer = DecodeBalancer(PS, kv_slack=0.02)
    balancer.update(_decode_report(workers[0], used=600, running=2), now=0.0)
    balancer.update(_decode_report(workers[1], used=300, running=9), now=0.0)
    balancer.update(_decode_report(workers[2], used=310, running=5), now=0.0)
    request = _request("a", [1] * 100, max_tokens=28)
    assert balancer.pick(request, workers, now=0.0) == workers[2]  # within 2% of the least KV
    balancer = DecodeBalancer(PS, kv_slack=0.0)
    for worker, used, running in zip(workers, (600, 300, 310), (2, 9, 5), strict=True):
        balancer.update(_decode_report(worker, used=used, running=running), now=0.0)
    assert balancer.pick(request, workers, now=0.0) == workers[1]


def test_decode_normalizes_by_each_ranks_capacity() -> None:
    workers = _workers(2, "decode")
    balancer = DecodeBalancer(PS, kv_slack=0.0)
    balancer.update(_decode_report(workers[0], used=400, running=4, total=1000), now=0.0)
    balancer.update(_decode_report(workers[1], used=600, running=4, total=4000), now=0.0)
    assert balancer.pick(_request("a", [1] * 100), workers, now=0.0) == workers[1]


def test_decode_finished_bookkeeping() -> None:
    workers = _workers(2, "decode")
    balancer = DecodeBalancer(PS)
    picks = [balancer.pick(_request(f"r{i}", [i] * 1000, max_tokens=512), workers, now=0.0) for i in range(4)]
    assert picks == [workers[0], workers[1], workers[0], workers[1]]
    balancer.finished("r0", workers[0])
    balancer.finished("r2", workers[0])
    balancer.finished("r2", workers[0])  # twice: no effect
    balancer.finished("nope", workers[1])
    assert balancer.pick(_request("r4", [4] * 1000, max_tokens=512), workers, now=0.0) == workers[0]
    assert balancer.pick(_request("r5", [5] * 1000, max_tokens=512), workers, now=0.0) == workers[0]


def test_decode_counts_committed_requests_over_a_stale_report() -> None:
    workers = _workers(2, "decode")
    balancer = DecodeBalancer(PS, report_margin=0.25)
    for i in range(3):
        balancer.pick(_request(f"r{i}", [1] * 1000, max_tokens=2048), [workers[0]], now=0.0)
    # the report covers the dispatches but shows their early, small KV: the footprint still counts
    balancer.update(_decode_report(workers[0], used=48, running=3), now=1.0)
    balancer.update(_decode_report(workers[1], used=60, running=1), now=1.0)
    assert balancer.pick(_request("x", [1] * 100), workers, now=1.0) == workers[1]
    # a restarted pool holds none of them any more
    balancer.update(_decode_report(workers[0], used=0, running=0, incarnation="2"), now=2.0)
    assert balancer.pick(_request("y", [1] * 100), workers, now=2.0) == workers[0]


def test_decode_remove_forgets_inflight() -> None:
    workers = _workers(2, "decode")
    balancer = DecodeBalancer(PS)
    for i in range(3):
        balancer.pick(_request(f"r{i}", [1] * 1000), [workers[0]], now=0.0)
    assert balancer.pick(_request("a", [2] * 100), workers, now=0.0) == workers[1]
    balancer.remove(workers[0])
    assert balancer.pick(_request("b", [3] * 100), workers, now=0.0) == workers[0]


# Every balancer ---------------------------------------------------------------------------------
ALL = [("load", "prefill"), ("load", "decode"), ("load", "colocated"), ("round_robin", "prefill")]


@pytest.mark.parametrize(("kind", "role"), ALL)
def test_candidates_edge_cases(kind: str, role: str) -> None:
    balancer = make_balancer(kind, role, PS)
    request = _request("a", [1] * 300)
    with pytest.raises(ValueError, match=r"no .*candidates"):
        balancer.pick(request, [], now=0.0)
    assert balancer.pick(request, ["only/0/0"], now=0.0) == "only/0/0"
    assert balancer.pick(_request("b", [2] * 300), ["only/0/0"], now=0.0) == "only/0/0"


@pytest.mark.parametrize(("kind", "role"), ALL)
def test_determinism(kind: str, role: str) -> None:
    """Same inputs, same picks; the order of the candidates does not matter."""
    arrivals = _workload(seed=3, count=60, rate=8.0, shared_prefixes=True)
    workers = _workers(3, role)

    def run(order: list[str]) -> list[str]:
        balancer = make_balancer(kind, role, PS)
        picks = []
        for i, arrival in enumerate(arrivals):
            picks.append(balancer.pick(arrival.request, order, arrival.at))
            if i % 7 == 6:
                balancer.finished(arrivals[i - 5].request.request_id, picks[i - 5])
                worker = workers[i % 3]
                report = LoadReport(worker=worker, incarnation="1", pending_prefill_tokens=i, kv_pages_used=i)
                balancer.update(report, arrival.at)
        return picks

    first = run(workers)
    assert run(workers) == first
    assert run(workers[::-1]) == first
    assert len(set(first)) == 3


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_draining_rank_only_when_all_drain(role: str) -> None:
    workers = _workers(2, role)
    balancer = make_balancer("load", role, PS)
    balancer.update(LoadReport(worker=workers[0], incarnation="1", draining=True), now=0.0)
    balancer.update(LoadReport(worker=workers[1], incarnation="1", kv_pages_used=500), now=0.0)
    assert balancer.pick(_request("a", [1] * 300), workers, now=0.0) == workers[1]
    assert balancer.pick(_request("b", [1] * 300), [workers[0]], now=0.0) == workers[0]


def test_round_robin_rotates_over_changing_candidates() -> None:
    balancer = RoundRobinBalancer()
    request = _request("a", [1] * 10)
    workers = ["p/0/0", "p/0/1", "p/0/2"]
    assert [balancer.pick(request, workers[::-1], now=0.0) for _ in range(4)] == [*workers, workers[0]]
    assert balancer.pick(request, ["p/0/0", "p/0/2"], now=0.0) == "p/0/2"  # p/0/1 left
    assert balancer.pick(request, ["p/0/0", "p/0/1", "p/0/2", "p/1/0"], now=0.0) == "p/1/0"


def test_registry() -> None:
    assert isinstance(make_balancer("load", "prefill", 64), PrefillBalancer)
    assert isinstance(make_balancer("load", "colocated", 64), PrefillBalancer)
    decode = make_balancer("load", "decode", 16)
    assert isinstance(decode, DecodeBalancer)
    assert decode.page_size == 16
    assert isinstance(make_balancer("round_robin", "decode", 64), RoundRobinBalancer)
    with pytest.raises(ValueError, match="'least_load'"):
        make_balancer("least_load", "prefill", 64)
    with pytest.raises(ValueError, match="'gateway'"):
        make_balancer("load", "gateway", 64)
    with pytest.raises(ValueError, match="page_size"):
        make_balancer("load", "prefill", 0)


@pytest.mark.parametrize(
    "make",
    [
        lambda: PrefillBalancer(PS, token_weight=-1),
        lambda: PrefillBalancer(PS, hot_prefix_cap=0.5),
        lambda: PrefillBalancer(PS, prefix_capacity=-1),
        lambda: DecodeBalancer(PS, kv_slack=-0.1),
        lambda: DecodeBalancer(PS, default_kv_pages=0),
        lambda: DecodeBalancer(0),
    ],
)
def test_bad_parameters(make: object) -> None:
    with pytest.raises(ValueError):
        make()  # type: ignore[operator]
