"""Attention-aware prefill chunking (dsinfer/base/chunking.py): the rule itself, the engine
scheduler's optional policy built on it, and the simulator's pools using the same rule."""

from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from dsinfer.base import chunking
from dsinfer.base.hashing import model_root
from dsinfer.base.kv_spec import KVCacheSpec
from dsinfer.base.sampling_params import SamplingParams
from dsinfer.cache.kv_manager import KVCacheManager
from dsinfer.cache.kv_pool import PagedKVPool
from dsinfer.engine.scheduler import Scheduler, StepResult
from dsinfer.engine.sequence import Sequence
from dsinfer.sim import pools as sim_pools
from dsinfer.sim.cache import SimCache
from dsinfer.sim.deployment import Assumptions, PoolSpec, chunking_weights
from dsinfer.sim.model_dims import ModelShape
from dsinfer.sim.simulator import Simulation
from dsinfer.sim.workload import TrafficProfile

PS = 16  # page size of the test KV pool


def _scheduler(budget: int, weight: float | None, context: float = 0.0, pages: int = 4096) -> Scheduler:
    kv = KVCacheManager(
        PagedKVPool(1, pages, KVCacheSpec.latent(4, "float32", PS)), root=model_root("chunking", str(PS))
    )
    return Scheduler(
        kv,
        max_num_seqs=64,
        max_num_batched_tokens=budget,
        attention_token_weight=weight,
        context_token_weight=context,
    )


def _seq(rid: str, prompt_len: int) -> Sequence:
    return Sequence(
        request_id=rid,
        choice=0,
        prompt_len=prompt_len,
        token_ids=[(7 * i + 13 * sum(map(ord, rid))) % 1000 for i in range(prompt_len)],
        params=SamplingParams(max_tokens=1),
        seed=0,
        max_tokens=1,  # a prefill rank's sequence: it ends with its first token
        eos_ids=frozenset(),
    )


def _engine_chunks(sched: Scheduler, seqs: list[Sequence]) -> list[list[tuple[str, int, int]]]:
    """Steps until every prompt is computed: per step, (request, start, tokens) of each prefill chunk."""
    for seq in seqs:
        sched.add(seq)
    steps = []
    while any(s.num_computed_tokens < s.prompt_len for s in seqs):
        batch = sched.schedule()
        steps.append([(i.seq.request_id, i.start, i.num_new) for i in batch.seqs])
        sched.postprocess(batch, [StepResult(tokens=[(1, None)] if i.samples else []) for i in batch.seqs])
    return steps


@pytest.mark.parametrize("first", [True, False])
def test_sim_repeats_the_engine_rule(first: bool) -> None:
    grid = itertools.product(
        (0, 1, 63, 500, 4096, 60000),
        (1, 2, 700, 20000),
        (0.5, 1, 37.0, 512, 4096),
        (512.0, 8192.0),
        (0.0, 1 / 36),
    )
    for start, remaining, budget, w, c in grid:
        args = (start, remaining, budget, w, c, first)
        n = chunking.fit_prefill_chunk(*args)
        assert 0 <= n <= remaining
        if n and not (first and n == 1):
            # the largest that fits (the step's first chunk may overshoot by its fixed decompression)
            room = (
                budget
                if first and chunking.prefill_chunk_cost(start, n, w, c) > budget
                else budget - start * c
            )
            assert chunking.prefill_chunk_cost(start, n, w, 0.0) <= room + 1e-9
            assert n == remaining or chunking.prefill_chunk_cost(start, n + 1, w, 0.0) > room
    # the step's first chunk always progresses, however long its context
    assert chunking.fit_prefill_chunk(60000, 100, 16, 8192.0, 1.0, True) >= 1
    assert chunking.fit_prefill_chunk(60000, 100, 16, 8192.0, 1.0, False) == 0


def test_engine_policy_shortens_long_context_chunks() -> None:
    # token budget only: every chunk of one long prompt is the budget
    plain = _engine_chunks(_scheduler(1024, None), [_seq("a", 8000)])
    assert [c[0][2] for c in plain[:-1]] == [1024] * 7
    # attention-aware: the further into the prompt, the more each token attends over, the shorter the chunk
    aware = _engine_chunks(_scheduler(1024, 2048.0), [_seq("a", 8000)])
    sizes = [c[0][2] for c in aware]
    assert sum(sizes) == 8000 and len(aware) > len(plain)
    assert all(x > y for x, y in itertools.pairwise(sizes[:-1]))
    for (_, start, n), *_ in aware[1:]:
        assert chunking.prefill_chunk_cost(start, n, 2048.0, 0.0) <= 1024 + 1e-9
    # a short prompt behind a long one shares the step only while budget is left
    mixed = _engine_chunks(_scheduler(1024, 2048.0), [_seq("long", 3000), _seq("short", 100)])
    for step in mixed:
        costs = [chunking.prefill_chunk_cost(s, n, 2048.0, 0.0) for _, s, n in step]
        assert sum(costs) <= 1024 + 1e-9


def test_engine_policy_counts_decodes_as_tokens() -> None:
    sched = _scheduler(64, 256.0)
    seq = _seq("d", 40)
    seq.max_tokens = 4
    _engine_chunks(sched, [seq])
    batch = sched.schedule()  # the prompt is in the cache and a token was sampled: it decodes
    assert [(i.start, i.num_new, i.is_decode) for i in batch.seqs] == [(40, 1, True)]
    with pytest.raises(ValueError, match="attention_token_weight"):
        _scheduler(64, 0.0)


def test_sim_pool_chunks_like_the_engine() -> None:
    """The simulated prefill rank composes its steps as the engine scheduler does (one rank, two
    prompts, the second arriving with a cached prefix of whole pages)."""
    w, c, budget = 1024.0, 0.05, 512
    spec = PoolSpec(
        "prefill",
        8,
        1,
        8,
        max_num_batched_tokens=budget,
        attention_token_weight=w,
        context_token_weight=c,
    )
    pool = sim_pools.PrefillPool(0, spec, SimCache().pool_model(spec, Assumptions()))
    pool.add(0, 1, 3000, 0)
    pool.add(0, 2, 2000, 1600)  # 1600 tokens cached: it computes [1600, 2000)
    sim_steps = []
    while pool.has_work():
        batch = pool.take()
        sim_steps.append(float(batch.tokens[0]))
    # the engine with the same prompts; the second one's first 1600 tokens cached by an earlier request
    sched = _scheduler(budget, w, c)
    again = _seq("x", 2000)
    earlier = _seq("x", 1600)
    earlier.token_ids = again.token_ids[:1600]
    _engine_chunks(sched, [earlier])
    sched._finish(earlier)  # its pages stay in the prefix cache
    engine_steps = [sum(n for _, _, n in step) for step in _engine_chunks(sched, [_seq("a", 3000), again])]
    assert again.num_cached_prompt_tokens == 1600
    assert sim_steps == engine_steps and len(sim_steps) > 3


def test_lockstep_pool_balances_step_cost() -> None:
    """On a pool of ranks stepping together, a long-context continuation no longer stretches
    every rank's attention stage: with the policy the slowest rank's is near the others'."""
    shape = ModelShape.preset("deepseek-v3")
    w, c = chunking_weights(shape)
    assert 2000 < w < 2700 and 0.07 < c < 0.1
    base = PoolSpec("prefill", 8, 1, 8, overlap=True, max_num_batched_tokens=4096)
    aware = PoolSpec(
        "prefill",
        8,
        1,
        8,
        overlap=True,
        max_num_batched_tokens=4096,
        attention_token_weight=w,
        context_token_weight=c,
    )
    imbalance = {}
    for name, spec in (("tokens", base), ("aware", aware)):
        pool = sim_pools.PrefillPool(0, spec, SimCache().pool_model(spec, Assumptions()))
        pool.add(0, 0, 32000, 30000)  # a continuation over a 30K-token history
        for r in range(1, 8):
            for j in range(4):
                pool.add(r, 10 * r + j, 2000, 0)
        batch = pool.take()
        imbalance[name] = pool.cost(batch, np.random.default_rng(0)).attention_imbalance
    assert imbalance["aware"] < 1.5 < 3 < imbalance["tokens"]


def test_simulated_pool_meets_ttft_better_with_the_policy() -> None:
    """DeepSeek's request mix on an EP8 pool at one load: with an 8192 budget, attention-aware
    chunking cuts the TTFT tail that lockstep steps stretched by long contexts cause."""
    root = Path(__file__).resolve().parent.parent
    traffic = TrafficProfile.load(root / "configs" / "traffic" / "small-day-night.yaml")
    w, c = chunking_weights(ModelShape.preset("deepseek-v3"))
    base = PoolSpec("prefill", 8, 1, 8, overlap=True, mtp=True, max_num_batched_tokens=8192)
    aware = replace(base, attention_token_weight=w, context_token_weight=c)
    cache = SimCache()
    res = {
        name: Simulation(traffic, spec, None, cache=cache).run(rate=10.0, duration=15.0, warmup=3.0)
        for name, spec in (("tokens", base), ("aware", aware))
    }
    assert res["aware"].ttft_p90 < 0.5 * res["tokens"].ttft_p90
    assert res["aware"].prefill_attention_imbalance < res["tokens"].prefill_attention_imbalance
    assert res["aware"].input_tokens == pytest.approx(res["tokens"].input_tokens, rel=0.1)
