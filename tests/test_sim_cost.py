"""Cost model: the published kernel tables are reproduced, the stage costs behave like rooflines,
the overlap schedules bound the step between the critical resource and the serial sum."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from dsinfer.sim.cost import PoolModel, decode_step, prefill_step
from dsinfer.sim.experts import expert_model
from dsinfer.sim.hardware import H100, H200, H800, get_hardware, with_measured
from dsinfer.sim.kernels import DEEPEP_LOW_LATENCY, DEEPGEMM_DENSE, DEEPGEMM_MASKED, Kernels
from dsinfer.sim.model_dims import ModelShape
from dsinfer.sim.schedule import DECODE_ORDER, PREFILL_ORDER, SERIAL_ORDER, step_time

SHAPE = ModelShape.preset("deepseek-v3")


def test_shape_is_deepseek_v3() -> None:
    assert (SHAPE.layers, SHAPE.dense_layers, SHAPE.experts, SHAPE.topk, SHAPE.mtp_layers) == (
        61,
        3,
        256,
        8,
        1,
    )
    assert 36e9 < SHAPE.active_params < 38e9  # "37B activated"
    assert SHAPE.latent_dim == 576
    assert SHAPE.dispatch_bytes == 7168 + 56 * 4 and SHAPE.combine_bytes == 2 * 7168


@pytest.mark.parametrize("shape", sorted(DEEPGEMM_DENSE))
def test_gemm_reproduces_deepgemm_table(shape: tuple[int, int]) -> None:
    k = Kernels(H800)
    n, kk = shape
    for m, tflops, _ in DEEPGEMM_DENSE[shape]:
        t = float(k.gemm(m, n, kk))
        assert 2 * m * n * kk / t / 1e12 == pytest.approx(tflops, rel=1e-9)
    times = k.gemm(np.arange(0, 9000, 97), n, kk)
    assert np.all(np.diff(times) > 0)  # more rows never cost less
    assert float(k.gemm(8192, n, kk)) == pytest.approx(2 * float(k.gemm(4096, n, kk)))  # constant rate above


def test_grouped_and_bf16_and_other_gpus() -> None:
    k = Kernels(H800)
    for m, tflops, _ in DEEPGEMM_MASKED[(4096, 7168)]:
        t = float(k.grouped_gemm(np.array([m]), 4096, 7168, "masked")[0])
        assert 2 * m * 4096 * 7168 / t / 1e12 == pytest.approx(tflops)
    # contiguous layout pads each group to 128 rows
    assert float(k.grouped_gemm(np.array([129]), 4096, 7168, "contiguous")[0]) == pytest.approx(
        float(k.grouped_gemm(np.array([256]), 4096, 7168, "contiguous")[0])
    )
    assert float(k.gemm(64, 7168, 2048, bf16=True)) == pytest.approx(2 * float(k.gemm(64, 7168, 2048)))
    # same compute and HBM: H100 times equal H800's; H200's extra bandwidth helps only memory-bound GEMMs
    assert float(Kernels(H100).gemm(64, 7168, 16384)) == float(k.gemm(64, 7168, 16384))
    assert float(Kernels(H200).gemm(64, 7168, 16384)) < 0.8 * float(k.gemm(64, 7168, 16384))
    assert float(Kernels(H200).gemm(8192, 7168, 16384)) == pytest.approx(float(k.gemm(8192, 7168, 16384)))
    assert get_hardware("H800") is H800
    with pytest.raises(ValueError, match="unknown hardware"):
        get_hardware("a100")


def test_deepep_tables() -> None:
    k = Kernels(H800)
    for ep, (d, c) in DEEPEP_LOW_LATENCY.items():
        assert k.ep_bandwidth(ep, "low_latency") == pytest.approx((d * 1e9, c * 1e9))
    assert k.ep_bandwidth(32, "normal") == pytest.approx((58e9, 57e9))
    # one node: NVLink, faster on H100's 900 GB/s than on H800's 400 GB/s
    assert k.ep_bandwidth(8, "normal")[0] == pytest.approx(153e9)
    assert Kernels(H100).ep_bandwidth(8, "normal")[0] > 2 * 153e9
    # 128 tokens x top-8 FP8 at EP128 take DeepEP's measured 192 us (within the table's rounding)
    assert 128 * 8 * SHAPE.dispatch_bytes / k.ep_bandwidth(128, "low_latency")[0] == pytest.approx(
        192e-6, rel=0.03
    )


def test_schedule_bounds() -> None:
    rng = np.random.default_rng(0)
    layers = 10
    st = {name: rng.uniform(1, 3, layers) for name in ("A0", "A1", "S", "M", "D", "C")}
    serial = step_time(st, SERIAL_ORDER, serial=True)
    assert serial == pytest.approx(sum(float(v.sum()) for v in st.values()))
    half = {name: v / 2 for name, v in st.items()}
    compute = sum(float(half[n].sum()) for n in ("A0", "A1", "S", "M")) * 2
    comm = sum(float(half[n].sum()) for n in ("D", "C")) * 2
    for order in (DECODE_ORDER, PREFILL_ORDER):
        t = step_time(half, order)
        assert max(compute, comm) <= t < serial
    # no communication: the overlapped step is exactly the compute
    quiet = {**half, "D": np.zeros(layers), "C": np.zeros(layers)}
    assert step_time(quiet, DECODE_ORDER) == pytest.approx(compute)


def _decode_pool(**kw: object) -> PoolModel:
    return PoolModel(SHAPE, Kernels(H800), expert_model(SHAPE, 144, 8, 32, "eplb", 0.5), **kw)  # type: ignore[arg-type]


def test_decode_step_behaves_like_a_roofline() -> None:
    pm = _decode_pool()
    ranks = 144

    def t(batch: float, ctx: float = 4989.0, model: PoolModel = pm) -> float:
        return decode_step(model, np.full(ranks, batch), np.full(ranks, batch * ctx)).time

    assert t(32) < t(64) < t(128)
    assert t(64, 2000) < t(64, 8000)
    # tokens per second per GPU grow with the batch (weights are read once per micro-batch)
    assert 128 / t(128) > 64 / t(64) > 32 / t(32)
    # two micro-batches hide transfers under compute; without overlap they add up
    assert t(128) < t(128, model=_decode_pool(overlap=False))
    # an MTP draft costs a step some time but yields 1 + acceptance tokens
    no_mtp = _decode_pool(mtp=False)
    assert t(128, model=no_mtp) < t(128) < 1.85 * t(128, model=no_mtp)
    # lockstep: one rank with twice the context slows the whole pool's step
    kv = np.full(ranks, 128 * 4989.0)
    kv[7] *= 2
    assert decode_step(pm, np.full(ranks, 128), kv).time > t(128)


def test_prefill_step_and_expert_balance() -> None:
    ranks = 32
    eplb = expert_model(SHAPE, ranks, 8, 32, "eplb", 0.5)
    contiguous = expert_model(SHAPE, ranks, 8, 32, "contiguous", 0.5)
    assert eplb.balance < 1.1 < contiguous.balance
    assert 1 <= eplb.node_fanout <= 4 and eplb.node_fanout < eplb.rank_fanout <= 8
    tokens = np.full(ranks, 16384.0)
    args = (tokens, tokens, np.full(ranks, 4 * 4096 * 4097 / 2), np.full(ranks, 4096.0), np.full(ranks, 4.0))
    k = Kernels(H800)
    fast = prefill_step(PoolModel(SHAPE, k, eplb, mtp=False), *args).time
    slow = prefill_step(PoolModel(SHAPE, k, contiguous, mtp=False), *args).time
    serial = prefill_step(PoolModel(SHAPE, k, eplb, overlap=False, mtp=False), *args).time
    assert fast < slow and fast < serial
    # a step of 16k tokens per GPU (4k prompts): 5-20 k tokens/s per GPU on the datasheet H800
    assert 5e3 < 16384 / fast < 20e3


def test_decode_mtp_layer_runs_after_the_verifying_head() -> None:
    """The MTP layer drafts from the token the main model's head just sampled, so it cannot be one
    more layer of the main pipeline: its transfers have no other layer to hide under."""
    slow_nic = Kernels(replace(H800, nic_bandwidth=H800.nic_bandwidth / 20))
    e = expert_model(SHAPE, 144, 8, 32, "eplb", 0.5)
    pm = PoolModel(SHAPE, slow_nic, e)
    batch = 128.0
    cost = decode_step(pm, np.full(144, batch), np.full(144, batch * 4989.0))
    # the MTP layer's four transfers (dispatch and combine of two micro-batches, one token per request)
    bw_d, bw_c = slow_nic.ep_bandwidth(144, "low_latency")
    per_mb = batch / 2 * SHAPE.topk
    transfers = 2 * per_mb * (SHAPE.dispatch_bytes / bw_d + SHAPE.combine_bytes / bw_c)
    assert cost.tail >= cost.breakdown["head"] + 0.95 * transfers
    no_mtp = decode_step(
        PoolModel(SHAPE, slow_nic, e, mtp=False), np.full(144, batch), np.full(144, batch * 4989.0)
    )
    assert no_mtp.tail == pytest.approx(no_mtp.breakdown["head"])


def test_prefill_comm_sms_and_mtp_layer() -> None:
    ranks = 32
    e = expert_model(SHAPE, ranks, 8, 32, "eplb", 0.0)
    tokens = np.full(ranks, 16384.0)
    args = (tokens, tokens, np.full(ranks, 4 * 4096 * 4097 / 2), np.full(ranks, 4096.0), np.full(ranks, 4.0))
    k = Kernels(H800)

    def t(**kw: object) -> float:
        return prefill_step(PoolModel(SHAPE, k, e, **kw), *args).time  # type: ignore[arg-type]

    # DeepSeek's profile: communication holds 24 SMs, computation gets 108 (compute-bound here)
    assert k.comm_sm_slowdown(24) == pytest.approx(132 / 108)
    assert t(mtp=False) < t(mtp=False, comm_sms=24) < t(mtp=False) * (132 / 108) / (132 / 112) * 1.001
    # the MTP layer over the prompt is one more (MoE) layer of the pipeline
    assert t(mtp=False) < t(mtp=True) < t(mtp=False) * 1.03
    with pytest.raises(ValueError, match="comm_sms"):
        k.comm_sm_slowdown(132)
    # a measured in-situ efficiency slows overlapped prefill compute only (here: the whole step)
    slow = Kernels(replace(H800, overlap_compute_efficiency=0.8))
    assert slow.comm_sm_slowdown(24) == pytest.approx(132 / 108 / 0.8)
    slowed = prefill_step(PoolModel(SHAPE, slow, e, mtp=False, comm_sms=24), *args).time  # type: ignore[arg-type]
    assert t(mtp=False, comm_sms=24) * 1.1 < slowed <= t(mtp=False, comm_sms=24) / 0.8 * 1.001
    serial = prefill_step(PoolModel(SHAPE, slow, e, mtp=False, overlap=False), *args).time  # type: ignore[arg-type]
    assert serial == pytest.approx(t(mtp=False, overlap=False))


def test_measured_ceilings_override_the_datasheet(tmp_path) -> None:  # type: ignore[no-untyped-def]
    assert with_measured(H100, tmp_path) == (H100, None)
    (tmp_path / "gpu_ceilings_h100.json").write_text(
        '{"overlap_compute_efficiency": 0.9, "hbm_bandwidth": 3.0e12}'
    )
    hw, path = with_measured(H100, tmp_path)
    assert path == tmp_path / "gpu_ceilings_h100.json"
    assert (hw.overlap_compute_efficiency, hw.hbm_bandwidth, hw.sms) == (0.9, 3.0e12, 132)
    (tmp_path / "gpu_ceilings_h100.json").write_text('{"overlap_compute_efficiency": 1.5}')
    with pytest.raises(ValueError, match="overlap_compute_efficiency"):
        with_measured(H100, tmp_path)
    (tmp_path / "gpu_ceilings_h100.json").write_text('{"tflops": 1}')
    with pytest.raises(ValueError, match="unknown fields"):
        with_measured(H100, tmp_path)


def test_v32_kv_accounting_and_sparse_decode() -> None:
    """V3.2's cache holds the FP8 indexer key beside the BF16 latent (1152 + 132 bytes per token per
    layer); its decode attention reads every key's indexer entry but runs MLA over at most 2048
    keys per request, so past the top-k its cost grows far slower with context than V3's."""
    from dsinfer.sim.cost import decode_attention

    v32 = ModelShape.preset("deepseek-v3.2")
    assert (v32.index_heads, v32.index_dim, v32.index_topk) == (64, 128, 2048)
    assert SHAPE.cache_bytes_per_layer == 1152 and v32.cache_bytes_per_layer == 1152 + 132
    from dsinfer.sim.deployment import PoolSpec, rank_shape

    def per_token(shape: ModelShape, model: str) -> int:
        spec = PoolSpec(
            role="decode", pool_size=144, nnodes=18, num_redundant_experts=32, mtp=True, model=model
        )
        return rank_shape(shape, spec).kv_bytes_per_token

    assert per_token(v32, "deepseek-v3.2") == 62 * 1284 and per_token(SHAPE, "deepseek-v3") == 62 * 1152
    k = Kernels(H800)
    requests = np.array([64.0])

    def attention(shape: ModelShape, context: int) -> float:
        a0, a1 = decode_attention(k, shape, requests, requests * context, 1)
        return float(a0[0] + a1[0])

    assert attention(v32, 1024) > attention(SHAPE, 1024)  # the indexer is pure overhead below the top-k
    growth_v3 = attention(SHAPE, 16384) / attention(SHAPE, 4096)
    growth_v32 = attention(v32, 16384) / attention(v32, 4096)
    assert growth_v3 > 2.5 and growth_v32 < 0.6 * growth_v3, (growth_v3, growth_v32)
    assert attention(v32, 16384) < 0.5 * attention(SHAPE, 16384)
