"""The discrete-event simulator: it routes with the gateway's own balancer classes, conserves
requests, degrades with load, and the load balancers beat round robin on imbalance."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

import dsinfer.balancers.decode
import dsinfer.balancers.prefill
import dsinfer.balancers.round_robin
from dsinfer.sim.analytic import analytic_decode_speed
from dsinfer.sim.cache import SimCache
from dsinfer.sim.deployment import Assumptions, PoolSpec
from dsinfer.sim.simulator import Simulation
from dsinfer.sim.workload import TrafficProfile

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parent.parent
TRAFFIC = TrafficProfile.load(ROOT / "configs" / "traffic" / "small-day-night.yaml")
PREFILL = PoolSpec("prefill", 8, 1, 8, overlap=True, mtp=True, max_num_seqs=256, max_num_batched_tokens=2048)
DECODE = PoolSpec("decode", 16, 2, 16, overlap=True, mtp=True, kv_cache_bytes=40 * 2**30, max_num_seqs=128)


def test_uses_the_gateway_balancers() -> None:
    sim = Simulation(TRAFFIC, PREFILL, DECODE)
    # the very classes the gateway runs (no copy inside dsinfer.sim)
    assert type(sim.balancers["prefill"]) is dsinfer.balancers.prefill.PrefillBalancer
    assert type(sim.balancers["decode"]) is dsinfer.balancers.decode.DecodeBalancer
    rr = Simulation(TRAFFIC, PREFILL, DECODE, assumptions=Assumptions(balancer="round_robin"))
    assert type(rr.balancers["decode"]) is dsinfer.balancers.round_robin.RoundRobinBalancer
    assert not any(p.name.startswith("balanc") for p in (ROOT / "dsinfer" / "sim").iterdir())


def test_end_to_end_pd() -> None:
    res = Simulation(TRAFFIC, PREFILL, DECODE, 2, 1).run(rate=8.0, duration=8.0, warmup=3.0)
    assert res.requests > 30
    assert res.ttft.size == res.requests and res.ttft.max() < 30.0  # all reached their first token
    assert 0 < res.ttft_p50 <= res.ttft_p90
    assert res.input_tokens > 0 and 0 < res.computed_tokens < res.input_tokens  # cache hits
    assert res.tokens_per_user > 20 and res.output_tokens > 0
    assert res.prefill_nodes == 2 and res.decode_nodes == 2
    s = res.summary()
    assert s["input_tok_s_per_node"] == pytest.approx(res.input_tokens / 8.0 / 2)


def test_load_degrades_service() -> None:
    light = Simulation(TRAFFIC, PREFILL, None).run(rate=4.0, duration=15.0, warmup=3.0)
    heavy = Simulation(TRAFFIC, PREFILL, None).run(rate=20.0, duration=15.0, warmup=3.0)
    assert light.ttft_p90 < heavy.ttft_p90
    d_light = Simulation(TRAFFIC, None, DECODE).run(rate=8.0, duration=6.0, warmup=2.0)
    d_heavy = Simulation(TRAFFIC, None, DECODE).run(rate=24.0, duration=6.0, warmup=2.0)
    assert d_light.mean_batch < d_heavy.mean_batch
    assert d_light.tokens_per_user > d_heavy.tokens_per_user
    # the simulated speed is at most the cost model's speed without imbalance at that batch
    a = Assumptions()
    assert d_heavy.tokens_per_user < analytic_decode_speed(DECODE, a, d_heavy.mean_batch, 4989) * 1.02
    # an overloaded decode pool is recognised even while its users' speed still looks fine
    over = Simulation(TRAFFIC, None, DECODE).run(rate=60.0, duration=6.0, warmup=2.0)
    assert over.decode_overloaded and not over.meets(TRAFFIC.slo)


def test_load_balancers_beat_round_robin() -> None:
    results = {}
    for kind in ("load", "round_robin"):
        a = Assumptions(balancer=kind)
        d = Simulation(TRAFFIC, None, DECODE, assumptions=a).run(rate=20.0, duration=6.0, warmup=2.0)
        p = Simulation(TRAFFIC, PREFILL, None, assumptions=a).run(rate=10.0, duration=15.0, warmup=3.0)
        results[kind] = (d, p)
    load, rr = results["load"], results["round_robin"]
    assert load[0].decode_attention_imbalance < rr[0].decode_attention_imbalance
    assert load[1].ttft_p90 < rr[1].ttft_p90


def test_expert_balancer_lowers_expert_imbalance() -> None:
    res = {}
    for policy in ("eplb", "contiguous"):
        a = Assumptions(expert_policy=policy)
        res[policy] = Simulation(TRAFFIC, None, DECODE, assumptions=a).run(
            rate=16.0, duration=4.0, warmup=1.0
        )
    assert res["eplb"].decode_expert_imbalance < res["contiguous"].decode_expert_imbalance
    # at EP16 the experts are not the critical path of a light step (the simulated step times differ
    # by the load each run happened to carry), but a full batch is faster with the balanced placement
    speed = {p: analytic_decode_speed(DECODE, Assumptions(expert_policy=p), 128, 4989) for p in res}
    assert speed["eplb"] > speed["contiguous"]


def test_cache_is_explicit_and_changes_no_result() -> None:
    # no module-level memo anywhere in the simulator
    for path in (ROOT / "dsinfer" / "sim").glob("*.py"):
        assert "lru_cache" not in path.read_text() and "functools.cache" not in path.read_text(), path
    cache = SimCache()
    a = Assumptions()
    first = cache.pool_model(PREFILL, a)
    misses = cache.misses
    assert cache.pool_model(PREFILL, a) is first and cache.misses == misses
    # another step budget: a new pool model, the same expert model (placement is not recomputed)
    other = cache.pool_model(replace(PREFILL, max_num_batched_tokens=4096), a)
    assert other is not first and other.experts is first.experts
    assert cache.lengths(TRAFFIC) is cache.lengths(TRAFFIC)
    # a shared cache and a fresh one simulate the same thing
    shared = Simulation(TRAFFIC, PREFILL, DECODE, cache=cache).run(rate=6.0, duration=4.0, warmup=2.0)
    fresh = Simulation(TRAFFIC, PREFILL, DECODE).run(rate=6.0, duration=4.0, warmup=2.0)
    assert shared.summary() == fresh.summary()
