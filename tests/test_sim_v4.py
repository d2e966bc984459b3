"""The simulator on DeepSeek-V4: its KV accounting is the engine's (pages of compressed entries and
indexer keys, each running sequence's window and compressor state set aside), its decode step
stays nearly flat with context where V3's grows with it, and a PD deployment of V4 pools runs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from dsinfer.base.model_config import read_model_config
from dsinfer.base.presets import resolve_model
from dsinfer.base.v4_config import V4Config
from dsinfer.base.v4_weights import V4ParameterCounts
from dsinfer.cache.v4_pool import V4StatePool
from dsinfer.sim import v4_cost
from dsinfer.sim.cost import decode_step, prefill_step
from dsinfer.sim.deployment import ACTIVATION_RESERVE, Assumptions, PoolSpec, kv_capacity_tokens, pool_model
from dsinfer.sim.hardware import H800
from dsinfer.sim.kernels import Kernels
from dsinfer.sim.model_dims import ModelShape
from dsinfer.sim.simulator import Simulation
from dsinfer.sim.workload import TrafficProfile

ROOT = Path(__file__).resolve().parent.parent
FLASH = "deepseek-v4-flash"


def _config(name: str) -> V4Config:
    config = read_model_config(resolve_model(name)[0] / "config.json")
    assert isinstance(config, V4Config)
    return config


@pytest.mark.parametrize("mtp", [False, True])
@pytest.mark.parametrize("name", [FLASH, "deepseek-v4-pro"])
def test_kv_capacity_is_the_engines(name: str, mtp: bool) -> None:
    """A --kv-cache-memory budget holds as many pages as the engine's V4 pool makes of it (with
    MTP, its layer's window is set aside per sequence too)."""
    config = _config(name)
    budget, seqs = 20 * 2**30, 64
    spec = PoolSpec("decode", 8, 1, 0, mtp=mtp, kv_cache_bytes=budget, max_num_seqs=seqs, model=name)
    page_bytes = V4StatePool.page_bytes_for(config, torch.bfloat16)
    reserve = V4StatePool.reserve_bytes_for(config, torch.bfloat16, seqs, int(mtp))
    pages = (budget - reserve) // page_bytes
    assert kv_capacity_tokens(spec, H800) == pages * V4StatePool.spec_for(config, torch.bfloat16).page_tokens
    shape = ModelShape.preset(name)
    assert shape.page_tokens == 256 and shape.v4 is not None
    # what fits beside the weights: FP8 layers, packed MXFP4 experts (this rank's slots), handoff slots
    fits = PoolSpec("decode", 64, 8, 0, mtp=mtp, max_num_seqs=seqs, model=name)
    share = 1 / 64  # of the routed experts, without redundant ones
    weights = V4ParameterCounts.of(config, int(mtp)).on_rank(2, True, True, share).total
    slot = V4StatePool.spec_for(config, torch.bfloat16, int(mtp)).sequence_bytes
    free = H800.hbm_bytes * (1 - ACTIVATION_RESERVE) - weights - seqs * slot
    expected = int((free - reserve) // page_bytes) * 256
    assert expected > 0 and kv_capacity_tokens(fits, H800) == expected


def test_v4_holds_far_more_tokens_than_v3() -> None:
    v3 = PoolSpec("decode", 144, 18, 32, kv_cache_bytes=26 * 2**30, max_num_seqs=64)
    v4 = PoolSpec("decode", 144, 18, 32, kv_cache_bytes=26 * 2**30, max_num_seqs=64, model=FLASH)
    assert kv_capacity_tokens(v4, H800) > 5 * kv_capacity_tokens(v3, H800)


def test_decode_step_nearly_flat_with_context() -> None:
    times = {}
    for model in ("deepseek-v3", FLASH):
        pm = pool_model(PoolSpec("decode", 144, 18, 32, overlap=True, mtp=True, model=model), Assumptions())
        requests = np.full(144, 32.0)
        times[model] = [
            decode_step(pm, requests, requests * ctx, np.random.default_rng(0)).time
            for ctx in (1024, 32768, 131072)
        ]
    v3, v4 = times["deepseek-v3"], times[FLASH]
    assert v4[0] < v4[1] < v4[2] < 1.5 * v4[0]  # HCA's entries and CSA's indexer scan still grow
    assert v3[2] > 5 * v3[0]
    assert v4[2] < v3[2] / 10


def test_layer_kinds_and_mtp_cost() -> None:
    """A CSA layer costs more than a sliding one (compressor, indexer, top-k entries); a hash layer
    runs no router; the MTP layer (sliding, routed) costs a step more."""
    shape = ModelShape.preset(FLASH)
    k = Kernels(H800)
    tokens, kv = np.array([64.0]), np.array([64.0 * 32768])
    layers = v4_cost.main_layers(shape)
    a0, a1 = v4_cost.decode_attention(k, shape, tokens, kv, 1, layers)
    kinds = [kind for kind, _ in layers]
    sliding, csa = kinds.index("sliding_attention"), kinds.index("compressed_sparse_attention")
    assert a0[csa, 0] > a0[sliding, 0] and a1[csa, 0] > a1[sliding, 0]
    _, hashed = v4_cost.decode_attention(k, shape, tokens, kv, 1, (("sliding_attention", False),))
    _, routed = v4_cost.decode_attention(k, shape, tokens, kv, 1, v4_cost.MTP_LAYERS)
    assert routed[0, 0] > hashed[0, 0]
    plain = PoolSpec("decode", 16, 2, 16, overlap=True, mtp=False, model=FLASH)
    mtp = PoolSpec("decode", 16, 2, 16, overlap=True, mtp=True, model=FLASH)
    requests = np.full(16, 32.0)
    t_plain = decode_step(pool_model(plain, Assumptions()), requests, requests * 4096).time
    t_mtp = decode_step(pool_model(mtp, Assumptions()), requests, requests * 4096).time
    assert t_plain < t_mtp < 2 * t_plain
    pm = pool_model(PoolSpec("prefill", 8, 1, 8, overlap=True, mtp=True, model=FLASH), Assumptions())
    chunk = np.full(8, 4096.0)
    cost = prefill_step(pm, chunk, chunk, chunk * 2048, np.full(8, 2048.0), np.full(8, 1.0))
    assert cost.time > 0 and cost.breakdown["A1"] > 0


@pytest.mark.system
def test_pd_deployment_of_v4_runs() -> None:
    traffic = TrafficProfile.load(ROOT / "configs" / "traffic" / "small-day-night.yaml")
    prefill = PoolSpec("prefill", 8, 1, 8, overlap=True, mtp=True, max_num_batched_tokens=2048, model=FLASH)
    decode = PoolSpec(
        "decode", 16, 2, 16, overlap=True, mtp=True, kv_cache_bytes=8 * 2**30, max_num_seqs=128, model=FLASH
    )
    sim = Simulation(traffic, prefill, decode, 1, 1)
    assert sim.page == 256 and sim.decode[0].total_pages == kv_capacity_tokens(decode, H800) // 256
    res = sim.run(rate=8.0, duration=6.0, warmup=2.0)
    assert res.requests > 20 and res.output_tokens > 0
    assert res.ttft.size == res.requests and 0 < res.ttft_p50 <= res.ttft_p90
