"""The weights model and the roofline that say what bounds MTP's speed-up (harness/mtp_bounds.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsinfer.base.config import ModelConfig
from dsinfer.sim.model_dims import ModelShape
from harness.checkpoints import MTP_WIDE, TINY_BASE
from harness.mtp_bounds import MTPBound, Roofline, distinct_experts, draft_params, measure_rates, step_params


def test_distinct_experts_matches_random_routing() -> None:
    gen = torch.Generator().manual_seed(0)
    for experts, topk, tokens in ((32, 4, 2), (256, 8, 2), (16, 4, 5), (256, 8, 64)):
        trials = [
            len({e for _ in range(tokens) for e in torch.randperm(experts, generator=gen)[:topk].tolist()})
            for _ in range(2000)
        ]
        assert distinct_experts(experts, topk, tokens) == pytest.approx(sum(trials) / len(trials), rel=0.02)
    assert distinct_experts(256, 8, 1) == pytest.approx(8)


def test_a_model_without_routing_choice_reads_the_same_weights_for_two_tokens() -> None:
    shape = dataclasses.replace(ModelShape.preset("deepseek-v3"), topk=256)  # every expert, every token
    assert step_params(shape, 2) == pytest.approx(step_params(shape, 1))
    assert MTPBound.of(shape, 1, 1.0).verify_vs_plain == pytest.approx(1.0)


def test_deepseek_v3_bound_reaches_its_published_speedup_at_a_large_batch_only() -> None:
    """DeepSeek reports about 1.8x decode throughput from MTP at 80-90% acceptance in its service
    (large batches per GPU); at batch 1 the second token's experts cost too much for that."""
    shape = ModelShape.preset("deepseek-v3")
    small, large = MTPBound.of(shape, 1, 0.85), MTPBound.of(shape, 256, 0.85)
    assert small.verify_vs_plain > 1.4 and small.speedup < 1.3
    assert large.verify_vs_plain == pytest.approx(1.0, abs=1e-3)
    assert 1.75 < large.speedup < 1.85
    # one MTP layer after 61 decoder layers: the draft is a small part of the step
    assert large.draft_share < 0.03 and large.layer_floor == pytest.approx(1 / 62)
    assert draft_params(shape, 256) < step_params(shape, 512) / 30


def test_more_drafts_raise_the_bound_slowly_at_batch_one_and_their_share_with_it() -> None:
    shape = ModelShape.preset("deepseek-v3")
    one = MTPBound.of(shape, 1, 1.0)
    assert MTPBound.of(shape, 1, 1.0, num_drafts=1) == one and one.num_drafts == 1
    bounds = [MTPBound.of(shape, 1, 1.0, n) for n in range(1, 6)]
    speedups, shares = [b.speedup for b in bounds], [b.draft_share for b in bounds]
    assert speedups == sorted(speedups) and shares == sorted(shares)
    # a rejected draft still costs its verification: half the drafts accepted yields less
    assert MTPBound.of(shape, 1, 0.5, 3).speedup < bounds[2].speedup
    assert bounds[2].layer_floor == pytest.approx(3 / 64)
    need = MTPBound.drafts_for(shape, 1, 1.5)
    assert need is not None and MTPBound.of(shape, 1, 1.0, need).speedup >= 1.5
    assert MTPBound.of(shape, 1, 1.0, need - 1).speedup < 1.5
    assert MTPBound.drafts_for(shape, 1, 100.0) is None


def test_a_roofline_reading_weights_only_is_the_weights_model() -> None:
    """With FLOPs free and no context to attend over, each part costs its bytes: the roofline's
    ratios are the weights model's, at any batch and depth."""
    shape = ModelShape.preset("deepseek-v3")
    memory_bound = Roofline(bandwidth=3e12, flops=float("inf"), weight_bytes=1, cache_bytes=2, context=0.0)
    for batch, drafts in ((1, 1), (16, 2), (256, 3)):
        bound = MTPBound.of(shape, batch, 0.9, drafts, memory_bound)
        assert bound.roofline_verify_vs_plain == pytest.approx(bound.verify_vs_plain)
        assert bound.roofline_draft_share == pytest.approx(bound.draft_share)
        assert bound.roofline_speedup == pytest.approx(bound.speedup)
    assert MTPBound.of(shape, 1, 0.9).roofline_speedup is None  # no roofline given


def test_where_a_step_is_set_by_its_arithmetic_drafting_only_loses() -> None:
    """Compute-bound, a verification of N + 1 tokens costs N + 1 plain steps: no acceptance pays
    for the drafts."""
    shape = ModelShape.preset("tiny-chat")
    compute_bound = Roofline(bandwidth=float("inf"), flops=1e11, weight_bytes=4, cache_bytes=4, context=64.0)
    for drafts in (1, 3):
        bound = MTPBound.of(shape, 64, 1.0, drafts, compute_bound)
        assert bound.roofline_verify_vs_plain == pytest.approx(drafts + 1)
        assert bound.roofline_speedup is not None and bound.roofline_speedup < 1.0


def test_a_cpu_roofline_bounds_a_wide_model_at_batch_64_near_one() -> None:
    """benchmarks/mtp_speed.py's `wide` model on a 2-core CPU (31 GB/s read, 200 GFLOP/s float32
    GEMM; context about 80): at batch 1 the weights set the bound, at batch 64 mostly the arithmetic
    does, so a verification costs well over a plain step (the EPYC measured 1.49x, and a speed-up of
    1.05-1.12x) and more drafts bound it lower."""
    shape = ModelShape.from_config(ModelConfig.from_dict({**TINY_BASE, **MTP_WIDE}))
    cpu = Roofline(bandwidth=31e9, flops=2e11, weight_bytes=4, cache_bytes=4, context=80.0)
    one, wide_batch = MTPBound.of(shape, 1, 1.0, 1, cpu), MTPBound.of(shape, 64, 1.0, 1, cpu)
    assert one.roofline_speedup == pytest.approx(one.speedup, rel=0.02)
    assert wide_batch.roofline_verify_vs_plain is not None
    assert wide_batch.verify_vs_plain < 1.3 < wide_batch.roofline_verify_vs_plain < 2.0
    assert wide_batch.roofline_speedup is not None and wide_batch.roofline_speedup < 1.15 < wide_batch.speedup
    three = MTPBound.of(shape, 64, 1.0, 3, cpu)
    assert three.roofline_speedup is not None and three.roofline_speedup < wide_batch.roofline_speedup


def test_measured_rates_are_a_machines() -> None:
    bandwidth, flops = measure_rates(torch.device("cpu"), torch.float32, 256)
    assert 1e8 < bandwidth < 1e13 and 1e8 < flops < 1e14


def test_a_draft_in_bf16_bounds_the_wide_model_higher_at_batch_64() -> None:
    """``--speculative-draft-dtype bfloat16`` under a float32 target, on the CPU of the test above
    (bf16 GEMMs at about twice float32's rate): the drafts read half the bytes and run at the bf16
    rate, so their share falls and the bound rises, at batch 1 and batch 64; the verification is
    the target's, unchanged."""
    shape = ModelShape.from_config(ModelConfig.from_dict({**TINY_BASE, **MTP_WIDE}))
    f32 = Roofline(bandwidth=31e9, flops=2e11, weight_bytes=4, cache_bytes=4, context=80.0)
    bf16 = dataclasses.replace(f32, flops=4e11, weight_bytes=2)
    for batch in (1, 64):
        same, drafted = MTPBound.of(shape, batch, 1.0, 3, f32), MTPBound.of(shape, batch, 1.0, 3, f32, bf16)
        assert drafted.roofline_verify_vs_plain == same.roofline_verify_vs_plain
        assert drafted.draft_share == pytest.approx(same.draft_share / (2 - same.draft_share))
        for name in ("roofline_draft_share", "roofline_speedup", "speedup"):
            lower, higher = (drafted, same) if "share" in name else (same, drafted)
            assert getattr(lower, name) < getattr(higher, name), name
