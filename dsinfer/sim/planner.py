"""Pools per role for a traffic profile and its SLO, as a day/night schedule, checked in the simulator.

1. Per role, the largest request rate one pool sustains within the SLO (``PoolCapacity``): a
   bisection over simulated rates, bracketed by the analytic capacity (cost model without
   imbalance). Prefill pools are judged on TTFT p90, decode pools on per-user tokens/s. Every
   simulation of one role uses the same seed, so the same requests arrive in the same order at
   any rate (common random numbers keep pass/fail nearly monotone in the rate); prefill, whose
   TTFT p90 is set by the few longest chunks, first scans a grid of rates. For prefill the plan
   also picks the per-rank token budget of a step (``max_num_batched_tokens``) among candidates:
   a smaller budget shortens the lockstep steps that a long-context chunk stretches.
2. The day is cut into ``blocks`` equal blocks; a block gets, per role, the fewest pools whose
   share of the block's peak rate fits one pool's capacity (the gateway spreads load over every
   rank of every pool of a role, so each pool carries rate / pools).
3. Each block is then simulated with its pools (one pool at rate / pools per role) and with one
   pool fewer of each role in turn: the plan meets the SLO, and fewer pools do not. Near the
   capacity a simulation's outcome is noisy (a few percent), so where the two disagree the
   block's count moves until both hold in the simulator.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from dsinfer.sim.analytic import analytic_decode_speed
from dsinfer.sim.cache import SimCache
from dsinfer.sim.cost import prefill_step
from dsinfer.sim.deployment import Assumptions, PoolSpec, kv_capacity_tokens
from dsinfer.sim.result import SimResult
from dsinfer.sim.simulator import Simulation
from dsinfer.sim.workload import DAY, TrafficProfile, calibrate, mean_rate, rate_at

Progress = Callable[[str], None]
PREFILL_GRID = (0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0)  # of the analytic capacity


@dataclass(frozen=True)
class SimWindow:
    duration: float = 30.0  # decode (a decode simulation costs ~10x a prefill one)
    warmup: float = 10.0
    prefill_duration: float = 90.0  # prefill: TTFT p90 needs many requests to settle

    def for_role(self, role: str) -> tuple[float, float]:
        return (self.prefill_duration if role == "prefill" else self.duration), self.warmup


@dataclass
class PoolCapacity:
    role: str
    rate: float  # requests/s one pool sustains within the SLO
    analytic_rate: float  # the cost model's capacity without imbalance
    result: SimResult | None  # the simulation at ``rate``
    probes: list[tuple[float, bool]] = field(default_factory=list)
    tokens_per_request: float = 0.0  # mean prompt (prefill, cache hits included) or output (decode)

    def tokens_per_node(self, spec: PoolSpec) -> float:
        return self.rate * self.tokens_per_request / spec.nnodes


@dataclass
class Block:
    start_h: float
    end_h: float
    peak_rate: float
    prefill_pools: int
    decode_pools: int
    checks: dict[str, tuple[bool, dict[str, float]]] = field(default_factory=dict)


@dataclass
class Plan:
    traffic: str
    prefill: PoolSpec
    decode: PoolSpec
    capacity: dict[str, PoolCapacity]
    blocks: list[Block]
    prefill_candidates: dict[int, PoolCapacity] = field(default_factory=dict)  # token budget -> capacity

    def mean_nodes(self, traffic: TrafficProfile) -> dict[str, float]:
        """Daily mean nodes per role: blocks weighted by their length."""
        hours = sum(b.end_h - b.start_h for b in self.blocks)
        p = sum((b.end_h - b.start_h) * b.prefill_pools for b in self.blocks) / hours * self.prefill.nnodes
        d = sum((b.end_h - b.start_h) * b.decode_pools for b in self.blocks) / hours * self.decode.nnodes
        return {"prefill": p, "decode": d, "total": p + d}

    def peak_nodes(self) -> int:
        return max(
            b.prefill_pools * self.prefill.nnodes + b.decode_pools * self.decode.nnodes for b in self.blocks
        )

    def verified(self) -> bool:
        return all(ok == (name == "plan") for b in self.blocks for name, (ok, _) in b.checks.items())


def _run(
    traffic: TrafficProfile, spec: PoolSpec, a: Assumptions, rate: float, window: SimWindow, cache: SimCache
) -> SimResult:
    prefill = spec if spec.role == "prefill" else None
    decode = spec if spec.role == "decode" else None
    duration, warmup = window.for_role(spec.role)
    return Simulation(traffic, prefill, decode, 1, 1, a, cache).run(rate, duration, warmup)


def analytic_rate(
    traffic: TrafficProfile, spec: PoolSpec, a: Assumptions, cache: SimCache | None = None
) -> float:
    """Requests/s one pool serves at the SLO in the cost model with every rank equal."""
    cache = cache or SimCache()
    lengths = cache.lengths(traffic)
    if spec.role == "prefill":
        pm = cache.pool_model(spec, a)
        ranks, new = spec.pool_size, lengths.mean_new_tokens
        cached = lengths.mean_prompt - new
        # a full step of mean requests: the new tokens attend over the cached prefix and themselves
        per_req_pairs = new * cached + new**2 / 2
        tokens = float(spec.max_num_batched_tokens)
        if spec.attention_token_weight is not None:  # the budget counts a mean request's chunk cost
            per_req_cost = (
                new + per_req_pairs / spec.attention_token_weight + cached * spec.context_token_weight
            )
            tokens *= new / per_req_cost
        reqs = tokens / new
        cost = prefill_step(
            pm,
            np.full(ranks, tokens),
            np.full(ranks, reqs * lengths.mean_prompt),
            np.full(ranks, reqs * per_req_pairs),
            np.full(ranks, lengths.mean_prompt),
            np.full(ranks, reqs),
        )
        return ranks * tokens / cost.time / new
    target = traffic.slo.min_tokens_per_s
    ctx = lengths.mean_decode_context
    kv_batch = kv_capacity_tokens(spec, a.hardware) * (1 - a.kv_growth_headroom) / ctx

    def speed(batch: float) -> float:
        return analytic_decode_speed(spec, a, max(batch, 1e-3), ctx, cache)

    lo, hi = 0.0, float(min(spec.max_num_seqs, kv_batch))
    if speed(hi) < target:
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if speed(mid) >= target else (lo, mid)
    batch = lo if hi - lo < 1e-6 or lo > 0 else hi
    return batch * spec.pool_size * speed(batch) / lengths.mean_output


def pool_capacity(
    traffic: TrafficProfile,
    spec: PoolSpec,
    a: Assumptions,
    window: SimWindow = SimWindow(),
    rel_tol: float = 0.02,
    progress: Progress | None = None,
    cache: SimCache | None = None,
) -> PoolCapacity:
    """The largest per-pool rate the simulation passes the SLO at (bisection to ``rel_tol``)."""
    slo = traffic.slo
    cache = cache or SimCache()
    lengths = cache.lengths(traffic)
    per_request = lengths.mean_prompt if spec.role == "prefill" else lengths.mean_output
    guess = analytic_rate(traffic, spec, a, cache)
    probes: list[tuple[float, bool]] = []
    results: dict[float, SimResult] = {}

    def ok(rate: float) -> bool:
        res = _run(traffic, spec, a, rate, window, cache)
        passed = res.meets(slo)
        probes.append((rate, passed))
        results[rate] = res
        if progress:
            progress(f"{spec.role} pool at {rate:.2f} req/s: {'meets' if passed else 'misses'} the SLO")
        return passed

    if spec.role == "prefill":
        # TTFT p90 is set by the longest chunks a step meets, so pass/fail is noisy in the rate:
        # scan a grid first, then refine above the highest rate that passed
        grid = [guess * f for f in PREFILL_GRID]
        passed = [r for r in grid if ok(r)]
        if not passed:
            return PoolCapacity(spec.role, 0.0, guess, results[grid[0]], probes, per_request)
        lo = max(passed)
        higher = [r for r in grid if r > lo]
        hi = higher[0] if higher else lo * 1.5
        if not higher:
            while ok(hi):
                lo, hi = hi, hi * 1.5
    else:
        lo, hi = 0.5 * guess, 1.2 * guess
        while not ok(lo):
            hi, lo = lo, lo * 0.5
            if lo < 1e-3 * guess:
                return PoolCapacity(spec.role, 0.0, guess, results[hi], probes, per_request)
        while ok(hi):
            lo, hi = hi, hi * 1.5
    while hi / lo > 1 + rel_tol:
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return PoolCapacity(spec.role, lo, guess, results[lo], probes, per_request)


def blocks_for(
    traffic: TrafficProfile, count: int, cache: SimCache | None = None
) -> list[tuple[float, float, float]]:
    """(start hour, end hour, peak request rate) of ``count`` equal blocks of the day."""
    lengths = (cache or SimCache()).lengths(traffic)
    out = []
    for b in range(count):
        start, end = 24.0 * b / count, 24.0 * (b + 1) / count
        t = np.linspace(start, end, 61) * 3600.0
        out.append((start, end, float(np.max(rate_at(traffic, t, lengths)))))
    return out


def budget_candidates(spec: PoolSpec, smallest: int = 1024) -> list[PoolSpec]:
    """``spec`` and the same pool with its step token budget halved down to ``smallest``."""
    out, budget = [], spec.max_num_batched_tokens
    while True:
        out.append(replace(spec, max_num_batched_tokens=budget))
        if budget // 2 < smallest:
            return out
        budget //= 2


def plan(
    traffic: TrafficProfile,
    prefill: PoolSpec | list[PoolSpec],
    decode: PoolSpec,
    a: Assumptions,
    blocks: int = 6,
    window: SimWindow = SimWindow(),
    verify: bool = True,
    progress: Progress | None = None,
    known: dict[str, dict[int, PoolCapacity]] | None = None,
    cache: SimCache | None = None,
) -> Plan:
    """``prefill``: one pool spec or candidates differing in token budget (the best is planned).
    ``known``: capacities already simulated with the same traffic, assumptions and window, per
    role and token budget (skips their bisection)."""
    known = known or {}
    cache = cache or SimCache()
    candidates = prefill if isinstance(prefill, list) else [prefill]

    def capacity_of(spec: PoolSpec) -> PoolCapacity:
        cached = known.get(spec.role, {}).get(spec.max_num_batched_tokens)
        return (
            cached
            if cached is not None
            else pool_capacity(traffic, spec, a, window, progress=progress, cache=cache)
        )

    tried = {c.max_num_batched_tokens: capacity_of(c) for c in candidates}
    best = max(candidates, key=lambda c: (tried[c.max_num_batched_tokens].rate, c.max_num_batched_tokens))
    prefill = best
    capacity = {"prefill": tried[best.max_num_batched_tokens], "decode": capacity_of(decode)}
    for role, cap in capacity.items():
        if cap.rate <= 0:
            raise ValueError(f"no {role} pool meets the SLO at any load (SLO {traffic.slo})")
    out = []
    for start, end, peak in blocks_for(traffic, blocks, cache):
        out.append(
            Block(
                start,
                end,
                peak,
                max(1, math.ceil(peak / capacity["prefill"].rate - 1e-9)),
                max(1, math.ceil(peak / capacity["decode"].rate - 1e-9)),
            )
        )
    result = Plan(traffic.name, prefill, decode, capacity, out, tried)
    if verify:
        for block in out:
            _verify(traffic, prefill, decode, a, block, window, progress, cache)
    return result


def _verify(
    traffic: TrafficProfile,
    prefill: PoolSpec,
    decode: PoolSpec,
    a: Assumptions,
    block: Block,
    window: SimWindow,
    progress: Progress | None,
    cache: SimCache,
) -> None:
    """Per role: the block's pool count meets the SLO in the simulator and one pool fewer does not.
    Where the simulation disagrees with the capacity estimate (its outcome is noisy within a few
    percent of the capacity), the count moves until both hold."""
    plan_summary: dict[str, dict[str, float]] = {}
    plan_ok = True
    for role, spec in (("prefill", prefill), ("decode", decode)):
        pools = block.prefill_pools if role == "prefill" else block.decode_pools
        seen: dict[int, tuple[bool, dict[str, float]]] = {}

        def check(n: int, role: str = role, spec: PoolSpec = spec, seen: dict = seen) -> bool:
            if n not in seen:
                res = _run(traffic, spec, a, block.peak_rate / n, window, cache)
                seen[n] = (res.meets(traffic.slo), {"pools": float(n), **res.summary()})
                if progress:
                    progress(
                        f"{block.start_h:04.1f}-{block.end_h:04.1f}h: {n} {role} pools at {block.peak_rate:.1f} req/s "
                        f"-> {'meets' if seen[n][0] else 'misses'} the SLO"
                    )
            return seen[n][0]

        for _ in range(8):
            if not check(pools):
                pools += 1
            elif pools > 1 and check(pools - 1):
                pools -= 1
            else:
                break
        if role == "prefill":
            block.prefill_pools = pools
        else:
            block.decode_pools = pools
        plan_ok &= seen[pools][0]
        plan_summary[role] = seen[pools][1]
        if pools > 1:
            block.checks[f"{role}-1"] = seen[pools - 1]
    block.checks["plan"] = (plan_ok, {f"{r}_{k}": v for r, s in plan_summary.items() for k, v in s.items()})


def daily_volume_check(traffic: TrafficProfile) -> dict[str, float]:
    """The traffic's daily input and output tokens as sampled (against the profile's targets)."""
    lengths = calibrate(traffic)
    requests = mean_rate(traffic, lengths) * DAY
    return {
        "requests_per_day": requests,
        "input_tokens_per_day": requests * lengths.mean_prompt,
        "output_tokens_per_day": requests * lengths.mean_output,
    }
