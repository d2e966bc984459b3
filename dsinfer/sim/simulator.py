"""Discrete-event simulation of a PD deployment routed by the gateway's own balancers.

Requests arrive (Poisson, :mod:`.workload`); the gateway's decode balancer, then its prefill
balancer (``dsinfer.balancers.make_balancer``: the code the gateway runs, not a copy) pick a rank
among every rank of every pool of the role, as the router does at admission. Each pool steps in
lockstep; a step lasts what :mod:`.cost` says for what every rank took. Every
``HEARTBEAT_INTERVAL`` each rank sends the balancer the ``LoadReport`` a worker would (queue,
pending prefill tokens and attention load; running, waiting and KV pages), and the balancer is
told when a request leaves a rank (``finished``), exactly as the gateway's router drives them.

A prompt's first token comes out of the prefill step that computes its last chunk (TTFT, plus
the transfer of its last layer's KV); its KV then lands on the decode rank chosen at admission.
With ``prefill=None`` requests go straight to decode; with ``decode=None`` they end at prefill.

Measured over ``[warmup, warmup + duration)``: TTFT of the requests arriving then (unfinished
ones count as infinite), the per-user decode speed (tokens produced / request-seconds spent in
decode, waiting included), throughput per node, and per-step imbalance: attention (slowest rank's
attention stage over the mean) and experts (busiest rank's routed rows over the mean).

Decode is started warm: ranks begin with the stationary population of a pool serving ``rate``
(each request's output length drawn length-biased, its progress uniform), routed by the balancer.
"""

from __future__ import annotations

import heapq

import numpy as np

from dsinfer.balancers import RouteRequest, make_balancer
from dsinfer.base.protocol import HEARTBEAT_INTERVAL, LoadReport
from dsinfer.sim.analytic import stationary_batch
from dsinfer.sim.cache import SimCache
from dsinfer.sim.cost import decode_step
from dsinfer.sim.deployment import Assumptions, PoolSpec, kv_capacity_tokens
from dsinfer.sim.pools import DecodePool, PrefillPool
from dsinfer.sim.result import SimResult
from dsinfer.sim.workload import Requests, TrafficProfile, arrivals, sample

_ARRIVE, _PREFILL_END, _DECODE_END, _KV_READY, _REPORT = range(5)
DRAIN = 30.0  # seconds after the window to let its requests reach their first token
WARM_START = 5.0  # seconds over which the warm decode population is routed before t = 0
WARM_TRIAL_RANKS = 24


class Simulation:
    def __init__(
        self,
        traffic: TrafficProfile,
        prefill: PoolSpec | None,
        decode: PoolSpec | None,
        prefill_pools: int = 1,
        decode_pools: int = 1,
        assumptions: Assumptions | None = None,
        cache: SimCache | None = None,
    ) -> None:
        """``cache``: pool models and the traffic's calibration, shared with other simulations
        (a new one when not given)."""
        if prefill is None and decode is None:
            raise ValueError("simulate at least one role")
        self.traffic = traffic
        self.a = assumptions or Assumptions()
        self.cache = cache or SimCache()
        self.lengths = self.cache.lengths(traffic)
        self.hw = self.a.hardware
        self.prefill_spec, self.decode_spec = prefill, decode
        self.prefill: list[PrefillPool] = []
        self.decode: list[DecodePool] = []
        if prefill is not None:
            pm = self.cache.pool_model(prefill, self.a)
            self.prefill = [PrefillPool(i, prefill, pm) for i in range(prefill_pools)]
        if decode is not None:
            pm = self.cache.pool_model(decode, self.a)
            kv = kv_capacity_tokens(decode, self.hw)
            self.decode = [
                DecodePool(i, decode, pm, kv, self.a.kv_growth_headroom) for i in range(decode_pools)
            ]
        any_spec = prefill if prefill is not None else decode
        assert any_spec is not None
        shape = self.cache.pool_model(any_spec, self.a).shape
        self.page = shape.page_tokens
        self.balancers = {
            role: make_balancer(self.a.balancer, role, self.page) for role in ("prefill", "decode")
        }
        self.prefill_names = [n for p in self.prefill for n in p.names]
        self.decode_names = [n for p in self.decode for n in p.names]
        self.layer_cache_bytes = shape.cache_bytes_per_layer
        self._ran = False

    # -----------------------------------------------------------------------------------------
    def run(self, rate: float, duration: float, warmup: float = 10.0, seed: int | None = None) -> SimResult:
        """Simulate ``rate`` requests/s (for the whole deployment) for ``warmup + duration`` s.
        A Simulation runs once (its pools keep their state)."""
        if self._ran:
            raise RuntimeError("a Simulation runs once; make a new one")
        self._ran = True
        seed = self.a.seed if seed is None else seed
        end = warmup + duration
        reqs = arrivals(self.traffic, rate, end, seed, self.lengths)
        n = len(reqs.arrival)
        self._reqs = reqs
        self._rng = np.random.default_rng(seed + 7)
        self._accept_rng = np.random.default_rng(seed + 11)
        self._events: list[tuple[float, int, int, int, int]] = []
        self._seq = 0
        self._dest: dict[int, tuple[int, int]] = {}  # request -> (decode pool, rank)
        self._first = np.full(n, np.inf)
        self._window = (warmup, end)
        self._awaiting_first = int(((reqs.arrival >= warmup) & (reqs.arrival < end)).sum())
        self._waiting_at_start: int | None = None
        res = SimResult(
            duration,
            len(self.prefill) * self._nodes(self.prefill_spec),
            len(self.decode) * self._nodes(self.decode_spec),
        )
        self._res = res
        self._stats: dict[str, list[float]] = {k: [] for k in ("pt", "pa", "pe", "dt", "da", "de", "batch")}
        if self.decode and rate > 0:
            self._warm_start(rate, seed, n)  # its requests get ids after the arrivals
        if n:
            self._push(reqs.arrival[0], _ARRIVE, 0)
        self._push(0.0, _REPORT, 0)
        horizon = end + DRAIN
        while self._events:
            t, _, kind, x, y = heapq.heappop(self._events)
            if t > horizon:
                break
            if kind == _REPORT:
                if t < end:
                    self._report(t)
                    self._push(t + HEARTBEAT_INTERVAL, _REPORT, 0)
                if t >= warmup and self._waiting_at_start is None:
                    self._waiting_at_start = sum(d.num_waiting() for d in self.decode)
            elif kind == _ARRIVE:
                self._arrive(t, x)
                if x + 1 < n and reqs.arrival[x + 1] < end:
                    self._push(reqs.arrival[x + 1], _ARRIVE, x + 1)
            elif kind == _PREFILL_END:
                self._prefill_end(t, x)
            elif kind == _DECODE_END:
                self._decode_end(t, x)
            elif kind == _KV_READY:
                self._kv_ready(t, x, y)
            if t >= end and (not self.prefill or self._awaiting_first == 0):
                break
        in_window = (reqs.arrival >= warmup) & (reqs.arrival < end)
        res.requests = int(in_window.sum())
        if self.prefill:
            res.ttft = self._first[:n][in_window] - reqs.arrival[in_window]
        st = self._stats
        res.prefill_steps, res.decode_steps = len(st["pt"]), len(st["dt"])
        res.prefill_step_time = float(np.mean(st["pt"])) if st["pt"] else 0.0
        res.decode_step_time = float(np.mean(st["dt"])) if st["dt"] else 0.0
        res.prefill_attention_imbalance = float(np.mean(st["pa"])) if st["pa"] else 1.0
        res.prefill_expert_imbalance = float(np.mean(st["pe"])) if st["pe"] else 1.0
        res.decode_attention_imbalance = float(np.mean(st["da"])) if st["da"] else 1.0
        res.decode_expert_imbalance = float(np.mean(st["de"])) if st["de"] else 1.0
        ranks = len(self.decode_names)
        res.mean_batch = float(np.sum(st["batch"]) / duration / ranks) if ranks else 0.0
        res.preemptions = sum(p.preemptions for p in self.decode)
        if self.decode:
            res.decode_backlog_growth = sum(d.num_waiting() for d in self.decode) - (
                self._waiting_at_start or 0
            )
        return res

    @staticmethod
    def _nodes(spec: PoolSpec | None) -> int:
        return 0 if spec is None else spec.nnodes

    def _push(self, t: float, kind: int, x: int, y: int = 0) -> None:
        self._seq += 1
        heapq.heappush(self._events, (float(t), self._seq, kind, x, y))

    def _route(self, req: int, prompt: int, cached: int, session: int) -> RouteRequest:
        pages = prompt // self.page
        shared = cached // self.page
        hashes = [b"s%d/%d" % (session, i) for i in range(shared)]
        hashes += [b"r%d/%d" % (req, i) for i in range(shared, pages)]
        max_tokens = self.traffic.output.max
        return RouteRequest(str(req), [0] * prompt, hashes, max_tokens)

    @staticmethod
    def _split(name: str) -> tuple[int, int]:
        _, pool, rank = name.split("/")
        return int(pool), int(rank)

    # events ----------------------------------------------------------------------------------
    def _arrive(self, t: float, i: int) -> None:
        r = self._reqs
        prompt, cached = int(r.prompt[i]), int(r.cached[i])
        route = self._route(i, prompt, cached, int(r.session[i]))
        if self.decode:
            self._dest[i] = self._split(self.balancers["decode"].pick(route, self.decode_names, t))
        if self.prefill:
            name = self.balancers["prefill"].pick(route, self.prefill_names, t)
            pool, rank = self._split(name)
            self.prefill[pool].add(rank, i, prompt, cached)
            if not self.prefill[pool].busy:
                self._start_prefill(t, pool)
        else:
            self._push(t, _KV_READY, i)

    def _start_prefill(self, t: float, pool: int) -> None:
        p = self.prefill[pool]
        batch = p.take()
        cost = p.cost(batch, self._rng)
        p.busy = True
        p.current = batch
        if self._window[0] <= t < self._window[1]:
            self._stats["pt"].append(cost.time)
            self._stats["pa"].append(cost.attention_imbalance)
            self._stats["pe"].append(cost.expert_imbalance)
            self._res.computed_tokens += float(batch.tokens.sum())
        self._push(t + cost.time, _PREFILL_END, pool)

    def _prefill_end(self, t: float, pool: int) -> None:
        p = self.prefill[pool]
        batch = p.current
        assert batch is not None
        r = self._reqs
        for rank, done in enumerate(batch.finishing):
            for i in done:
                prompt = int(r.prompt[i])
                tail = prompt * self.layer_cache_bytes / self.hw.nic_bandwidth
                self._first[i] = t + tail
                if self._window[0] <= r.arrival[i] < self._window[1]:
                    self._awaiting_first -= 1
                if self._window[0] <= t < self._window[1]:
                    self._res.input_tokens += prompt
                self.balancers["prefill"].finished(str(i), p.names[rank])
                if self.decode:
                    self._push(t + tail, _KV_READY, i)
        p.busy = False
        if p.has_work():
            self._start_prefill(t, pool)

    def _kv_ready(self, t: float, i: int, _: int) -> None:
        r = self._reqs
        if self._window[0] <= t < self._window[1]:
            self._res.decode_arrivals += 1
        remaining = int(r.output[i]) - 1  # the first token came from prefill
        pool, rank = self._dest[i]
        if remaining <= 0:
            self.balancers["decode"].finished(str(i), self.decode[pool].names[rank])
            return
        d = self.decode[pool]
        d.enqueue(rank, i, int(r.prompt[i]) + 1, remaining)
        if not d.busy:
            self._start_decode(t, pool)

    def _start_decode(self, t: float, pool: int) -> None:
        d = self.decode[pool]
        d.admit(t)
        cost = d.start_step(self._rng)
        if cost.time <= 0:
            d.busy = False
            return
        d.busy = True
        d.step_started = t
        d.step_present = d.num_active() + d.num_waiting()
        if self._window[0] <= t < self._window[1]:
            self._stats["dt"].append(cost.time)
            self._stats["da"].append(cost.attention_imbalance)
            self._stats["de"].append(cost.expert_imbalance)
        self._push(t + cost.time, _DECODE_END, pool)

    def _decode_end(self, t: float, pool: int) -> None:
        d = self.decode[pool]
        start = d.step_started
        running = len(d.step_slots)
        tokens, finished = d.finish_step(self.a.mtp_acceptance, self._accept_rng)
        lo, hi = self._window
        overlap = max(0.0, min(t, hi) - max(start, lo))
        if overlap > 0:
            share = overlap / (t - start)
            self._res.output_tokens += tokens * share
            self._res.decode_presence += d.step_present * overlap
            self._stats["batch"].append(running * overlap)
        for i in finished:
            self.balancers["decode"].finished(str(i), d.names[self._dest[i][1]])
        d.busy = False
        if d.has_work():
            self._start_decode(t, pool)

    def _report(self, t: float) -> None:
        for role, pools in (("prefill", self.prefill), ("decode", self.decode)):
            balancer = self.balancers[role]
            for p in pools:
                for report in p.reports():
                    balancer.update(report, t)

    # warm start ------------------------------------------------------------------------------
    def _warm_start(self, rate: float, seed: int, first_id: int) -> int:
        spec = self.decode_spec
        assert spec is not None
        lengths = self.lengths
        per_pool = rate / len(self.decode)
        ctx = lengths.mean_decode_context
        batch = stationary_batch(spec, self.a, per_pool, lengths.mean_output, ctx, cache=self.cache)
        slowdown = self._warm_slowdown(batch, seed)
        batch = stationary_batch(spec, self.a, per_pool, lengths.mean_output, ctx, slowdown, self.cache)
        # an overloaded pool starts full; its queue then grows during the window
        batch = min(batch, spec.max_num_seqs)
        count = round(batch * spec.pool_size * len(self.decode))
        if count <= 0:
            return 0
        pool_reqs, pick, progress = self._population(count, seed + 1000)
        ids = first_id + np.arange(count)
        self._extend(pool_reqs, pick, ids)
        # picked over the WARM_START seconds before t = 0, with the reports that would have come
        times = np.linspace(-WARM_START, 0.0, count, endpoint=False)
        next_report = -WARM_START + HEARTBEAT_INTERVAL
        for j, i in enumerate(ids.tolist()):
            t = float(times[j])
            if t >= next_report:
                for d in self.decode:
                    d.admit(t)
                self._report(t)
                next_report += HEARTBEAT_INTERVAL
            prompt = int(pool_reqs.prompt[pick[j]])
            route = self._route(
                i, prompt, int(pool_reqs.cached[pick[j]]), int(pool_reqs.session[pick[j]]) + 10**9
            )
            pool, rank = self._split(self.balancers["decode"].pick(route, self.decode_names, t))
            self._dest[i] = (pool, rank)
            remaining = int(pool_reqs.output[pick[j]]) - 1 - int(progress[j])
            if remaining > 0:
                self.decode[pool].enqueue(rank, i, prompt + 1 + int(progress[j]), remaining)
            else:
                self.balancers["decode"].finished(str(i), self.decode[pool].names[rank])
        for pool, d in enumerate(self.decode):
            if d.has_work():
                self._start_decode(0.0, pool)
        return count

    def _population(self, count: int, seed: int) -> tuple[Requests, np.ndarray, np.ndarray]:
        """``count`` requests in decode at a random instant: chosen length-biased by output, each
        at a uniform point of its output -> (requests, picked indices, tokens already produced)."""
        reqs = sample(self.traffic, 8 * count + 64, seed, self.lengths)
        rng = np.random.default_rng(seed + 13)
        weights = reqs.output.astype(np.float64)
        pick = rng.choice(len(weights), size=count, p=weights / weights.sum())
        progress = (rng.random(count) * reqs.output[pick]).astype(np.int64)
        return reqs, pick, progress

    def _warm_slowdown(self, batch: float, seed: int) -> float:
        """Simulated over analytic step time at ``batch`` per rank: a trial population on up to
        WARM_TRIAL_RANKS ranks, routed by a fresh balancer of the same kind (with reports), its
        per-rank load tiled over the pool, one noisy step."""
        spec = self.decode_spec
        assert spec is not None
        ranks = min(spec.pool_size, WARM_TRIAL_RANKS)
        count = round(batch * ranks)
        if count <= 0:
            return 1.0
        reqs, pick, progress = self._population(count, seed + 2000)
        balancer = make_balancer(self.a.balancer, "decode", self.page)
        names = [f"decode/0/{r}" for r in range(ranks)]
        running, kv = np.zeros(ranks), np.zeros(ranks)
        pages = np.zeros(ranks)
        total = self.decode[0].total_pages
        for j in range(count):
            t = -WARM_START + WARM_START * j / count
            if j % max(1, count // 10) == 0:
                for r, name in enumerate(names):
                    balancer.update(
                        LoadReport(
                            worker=name,
                            incarnation="trial",
                            num_running=int(running[r]),
                            kv_pages_used=int(pages[r]),
                            kv_pages_total=total,
                        ),
                        t,
                    )
            i = int(pick[j])
            prompt = int(reqs.prompt[i])
            route = self._route(-1 - j, prompt, int(reqs.cached[i]), int(reqs.session[i]))
            r = int(balancer.pick(route, names, t).rsplit("/", 1)[1])
            context = prompt + 1 + int(progress[j])
            running[r] += 1
            kv[r] += context
            pages[r] += -(-context // self.page)
        pm = self.cache.pool_model(spec, self.a)
        tiled = np.resize(np.arange(ranks), spec.pool_size)
        noisy = decode_step(pm, running[tiled], kv[tiled], np.random.default_rng(seed + 17)).time
        lengths = self.lengths
        ideal = decode_step(
            pm,
            np.full(spec.pool_size, count / ranks),
            np.full(spec.pool_size, count / ranks * lengths.mean_decode_context),
            None,
        ).time
        return max(1.0, noisy / ideal) if ideal > 0 else 1.0

    def _extend(self, pool_reqs: Requests, pick: np.ndarray, ids: np.ndarray) -> None:
        r = self._reqs
        self._reqs = Requests(
            np.concatenate([r.arrival, np.full(len(ids), -1.0)]),
            np.concatenate([r.prompt, pool_reqs.prompt[pick]]),
            np.concatenate([r.cached, pool_reqs.cached[pick]]),
            np.concatenate([r.output, pool_reqs.output[pick]]),
            np.concatenate([r.session, pool_reqs.session[pick]]),
        )
        self._first = np.concatenate([self._first, np.zeros(len(ids))])
