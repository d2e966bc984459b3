"""The DeepSeek-V3 noaux_tc MoE gate, the torch reference and the CPU kernel (numba), against a
brute-force python reference."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from dsinfer.ops import Ops, select_ops


@pytest.fixture(params=["torch", "numba"])
def ops(request: pytest.FixtureRequest) -> Ops:
    ops = select_ops(torch.device("cpu"), prefer=request.param)
    assert ops.backends["gate"] == request.param
    return ops


def _brute_force(
    logits: list[float],
    bias: list[float] | None,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm: bool,
    scale: float,
) -> tuple[list[float], list[int]]:
    """One token, plain python: enumerate every choice of topk_group groups explicitly."""
    num_experts = len(logits)
    s = [1.0 / (1.0 + math.exp(-v)) for v in logits]
    choice = [s[e] + (bias[e] if bias is not None else 0.0) for e in range(num_experts)]
    per_group = num_experts // n_group
    members = [list(range(g * per_group, (g + 1) * per_group)) for g in range(n_group)]
    group_score = [sum(sorted((choice[e] for e in m), reverse=True)[:2]) for m in members]
    best = max(
        itertools.combinations(range(n_group), topk_group), key=lambda c: sum(group_score[g] for g in c)
    )
    allowed = sorted(e for g in best for e in members[g])
    ids = sorted(allowed, key=lambda e: choice[e], reverse=True)[:top_k]
    weights = [s[e] for e in ids]
    if norm:
        total = sum(weights) + 1e-20
        weights = [w / total for w in weights]
    return [w * scale for w in weights], ids


@pytest.mark.parametrize(
    ("num_experts", "top_k", "n_group", "topk_group", "norm", "bias_kind"),
    [
        (32, 4, 8, 3, True, "negative"),  # negative choice scores: -inf masking (not 0.0) matters
        (32, 6, 4, 2, True, "mixed"),
        (24, 3, 4, 1, False, "negative"),
        (16, 4, 1, 1, True, "mixed"),  # n_group == 1: no group limit
        (16, 2, 4, 4, False, "none"),  # all groups kept
    ],
)
def test_moe_gate_matches_brute_force(
    ops: Ops, num_experts: int, top_k: int, n_group: int, topk_group: int, norm: bool, bias_kind: str
) -> None:
    gen = torch.Generator().manual_seed(num_experts * 100 + top_k * 10 + n_group)
    tokens = 40
    logits = torch.randn(tokens, num_experts, generator=gen) * 2
    bias = {
        "negative": -2.0 - torch.rand(num_experts, generator=gen) * 3,
        "mixed": torch.randn(num_experts, generator=gen),
        "none": None,
    }[bias_kind]
    scale = 2.5
    weights, ids = ops.moe_gate(logits, bias, top_k, n_group, topk_group, norm, scale)
    assert weights.shape == (tokens, top_k) and weights.dtype == torch.float32
    assert ids.shape == (tokens, top_k) and ids.dtype == torch.int64
    for t in range(tokens):
        ref_w, ref_ids = _brute_force(
            logits[t].tolist(),
            None if bias is None else bias.tolist(),
            top_k,
            n_group,
            topk_group,
            norm,
            scale,
        )
        assert ids[t].tolist() == ref_ids
        torch.testing.assert_close(weights[t].double(), torch.tensor(ref_w, dtype=torch.float64))
    if norm:
        torch.testing.assert_close(weights.sum(-1), torch.full((tokens,), scale))


def test_moe_gate_negative_bias_never_picks_masked_group(ops: Ops) -> None:
    """With every choice score negative, masking dropped groups with 0.0 would select them."""
    logits = torch.zeros(1, 8)
    bias = torch.tensor([-1.0, -1.0, -3.0, -3.0, -3.0, -3.0, -3.0, -3.0])
    _, ids = ops.moe_gate(logits, bias, 4, 4, 2, True, 1.0)
    # groups {0,1} (score -1) and one of the -5 groups are kept: experts 0, 1 and two of 2..7
    assert {0, 1} <= set(ids[0].tolist())
    groups = {e // 2 for e in ids[0].tolist()}
    assert len(groups) == 2


def test_moe_gate_zero_tokens(ops: Ops) -> None:
    weights, ids = ops.moe_gate(torch.empty(0, 16), torch.zeros(16), 4, 4, 2, True, 1.0)
    assert weights.shape == (0, 4) and ids.shape == (0, 4) and ids.dtype == torch.int64


def test_moe_gate_rejects_bad_config(ops: Ops) -> None:
    with pytest.raises(ValueError):
        ops.moe_gate(torch.zeros(2, 16), None, 4, 3, 1, True, 1.0)  # 16 % 3 != 0
    with pytest.raises(ValueError):
        ops.moe_gate(torch.zeros(2, 16), None, 9, 4, 2, True, 1.0)  # 9 > 2 groups x 4 experts
