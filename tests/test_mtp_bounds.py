"""The weights model that says what bounds MTP's speed-up (harness/mtp_bounds.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsinfer.sim.model_dims import ModelShape
from harness.mtp_bounds import MTPBound, distinct_experts, draft_params, step_params


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
