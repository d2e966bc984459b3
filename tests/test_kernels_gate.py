"""The fused Triton MoE gate of dsinfer.kernels against the torch reference of dsinfer.ops.gate, on CPU.

Runs under ``TRITON_INTERPRET=1`` in a fresh interpreter, as tests/test_kernels_gemm.py explains
(``python -m tests.test_kernels_gate`` prints the JSON of check results). Expert ids must be
identical and weights within 1e-6 (a few fp32 ulps of weights up to ``routed_scaling_factor``:
sigmoid and the renormalizing sum may round differently).

Exact ties: the kernel takes the lowest index first (groups, then experts), the order a stable
descending sort gives. ``torch.topk`` leaves the order of equal values unspecified (on CPU it is
not the lowest index), so tied inputs are checked against a stable-sort transcription of the
reference (itself checked to equal the reference on untied inputs) and, where every tie is between
identical copies, against the reference itself up to the labels of the copies.
"""

from __future__ import annotations

import importlib
import json
from types import ModuleType

import pytest
import torch

from tests.test_kernels_gemm import launches, run_checks, subprocess_checks

pytestmark = pytest.mark.system

GEN_SEED = 4321
WEIGHT_ATOL = 1e-6

# (experts, top_k, n_group, topk_group, norm, scale, bias kind)
CONFIGS: tuple[tuple[int, int, int, int, bool, float, str | None], ...] = (
    (256, 8, 8, 4, True, 2.5, "mixed"),  # DeepSeek-V3
    (32, 4, 8, 3, True, 1.0, "negative"),  # negative choice scores: masked groups must be -inf
    (24, 3, 4, 1, False, 1.0, "negative"),  # 6 experts per group (not a power of two)
    (16, 4, 1, 1, True, 1.5, "mixed"),  # one group: no group limit
    (16, 2, 4, 4, False, 1.0, None),  # every group kept, no bias
    (8, 2, 8, 2, True, 1.0, "mixed"),  # one expert per group: group score is its top-1
    (64, 6, 8, 3, True, 2.5, "positive"),
)


def _kernel_module() -> ModuleType:
    # The package re-exports the function under the module's own name: fetch the module itself.
    return importlib.import_module("dsinfer.kernels.moe_gate")


def _bias(gen: torch.Generator, experts: int, kind: str | None) -> torch.Tensor | None:
    if kind is None:
        return None
    b = torch.rand(experts, generator=gen)
    return {"negative": -2.0 * b, "positive": b, "mixed": 2.0 * b - 1.0}[kind]


def _stable_gate(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ops/gate.py with ``topk`` replaced by a stable descending sort: ties go to the lowest index."""
    tokens, experts = logits.shape
    scores = logits.float().sigmoid()
    choice = scores if bias is None else scores + bias.float()[None, :]
    if n_group > 1 and topk_group < n_group:
        grouped = choice.view(tokens, n_group, -1)
        group_scores = grouped.sort(dim=-1, descending=True).values[..., :2].sum(dim=-1)
        keep = group_scores.sort(dim=-1, descending=True, stable=True).indices[:, :topk_group]
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        choice = choice.masked_fill(~group_mask.repeat_interleave(experts // n_group, dim=1), float("-inf"))
    ids = choice.sort(dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = scores.gather(1, ids)
    if norm:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale, ids


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(((a - b).abs() <= WEIGHT_ATOL).all())


def check_gate_matches_reference() -> None:
    """Identical ids, weights within 1e-6: several configs, one token and ragged token counts."""
    kmod = _kernel_module()
    from dsinfer.ops.gate import moe_gate

    gen = torch.Generator().manual_seed(GEN_SEED)
    for experts, top_k, n_group, topk_group, norm, scale, kind in CONFIGS:
        for tokens in (1, 37):
            logits = torch.randn(tokens, experts, generator=gen) * 2
            bias = _bias(gen, experts, kind)
            args = (top_k, n_group, topk_group, norm, scale)
            with launches(kmod._moe_gate_kernel) as calls:
                weights, ids = kmod.moe_gate(logits, bias, *args)
            ref_weights, ref_ids = moe_gate(logits, bias, *args)
            what = f"E={experts} top_k={top_k} groups={n_group}/{topk_group} T={tokens} bias={kind}"
            assert len(calls) == 1, f"{what}: {len(calls)} launches"
            assert weights.dtype == torch.float32 and ids.dtype == torch.int64, f"{what}: dtypes"
            assert torch.equal(ids, ref_ids), f"{what}: ids differ\n{ids}\n{ref_ids}"
            assert _close(weights, ref_weights), f"{what}: max err {(weights - ref_weights).abs().max():.2e}"
            stable = _stable_gate(logits, bias, *args)
            assert torch.equal(stable[1], ref_ids), (
                f"{what}: the stable transcription drifted from ops/gate.py"
            )


def check_gate_input_layouts() -> None:
    """bf16 logits, a strided (non-contiguous) logits view, a bf16 bias."""
    kmod = _kernel_module()
    from dsinfer.ops.gate import moe_gate

    gen = torch.Generator().manual_seed(GEN_SEED + 1)
    wide = torch.randn(64, 19, generator=gen)
    cases = [
        (torch.randn(9, 64, generator=gen).to(torch.bfloat16), torch.randn(64, generator=gen) * 0.1),
        (wide.t(), (torch.randn(64, generator=gen) * 0.1).to(torch.bfloat16)),
    ]
    for logits, bias in cases:
        with launches(kmod._moe_gate_kernel) as calls:
            weights, ids = kmod.moe_gate(logits, bias, 6, 8, 3, True, 2.5)
        ref_weights, ref_ids = moe_gate(logits, bias, 6, 8, 3, True, 2.5)
        what = f"logits {logits.dtype} strides {logits.stride()} bias {bias.dtype}"
        assert len(calls) == 1, f"{what}: {len(calls)} launches"
        assert torch.equal(ids, ref_ids), f"{what}: ids differ"
        assert _close(weights, ref_weights), f"{what}: weights differ"


def check_gate_ties() -> None:
    """Exact ties among groups and experts: lowest index first, same weights as the reference."""
    kmod = _kernel_module()
    from dsinfer.ops.gate import moe_gate

    gen = torch.Generator().manual_seed(GEN_SEED + 2)
    # Many ties of every kind: logits and bias from small sets (equal choice <=> equal logit and bias).
    for experts, top_k, n_group, topk_group in ((32, 4, 4, 2), (64, 8, 8, 3), (24, 5, 4, 2), (16, 3, 1, 1)):
        logits = torch.randint(-2, 3, (29, experts), generator=gen).float()
        bias = 0.25 * torch.randint(0, 2, (experts,), generator=gen).float()
        args = (top_k, n_group, topk_group, True, 2.5)
        with launches(kmod._moe_gate_kernel) as calls:
            weights, ids = kmod.moe_gate(logits, bias, *args)
        ref_weights, ref_ids = _stable_gate(logits, bias, *args)
        what = f"ties E={experts} top_k={top_k} groups={n_group}/{topk_group}"
        assert len(calls) == 1, f"{what}: {len(calls)} launches"
        assert torch.equal(ids, ref_ids), f"{what}: ids differ from lowest-index ties\n{ids}\n{ref_ids}"
        assert _close(weights, ref_weights), f"{what}: weights differ"

    # Ties only between identical copies (group 2 copies group 1; experts copied inside groups):
    # the torch reference may pick other copies, but its weights and choice scores must be ours.
    experts, top_k, n_group, topk_group = 32, 6, 4, 2
    logits = torch.randn(31, experts, generator=gen)
    bias = torch.rand(experts, generator=gen) * 0.2
    for t in (logits, bias.unsqueeze(0)):
        t[:, 16:24] = t[:, 8:16]
        t[:, 3] = t[:, 1]
        t[:, 29] = t[:, 26]
    args = (top_k, n_group, topk_group, False, 1.0)
    weights, ids = kmod.moe_gate(logits, bias, *args)
    stable_weights, stable_ids = _stable_gate(logits, bias, *args)
    ref_weights, ref_ids = moe_gate(logits, bias, *args)
    choice = logits.sigmoid() + bias
    assert torch.equal(ids, stable_ids), "copies: ids differ from lowest-index ties"
    assert _close(weights, ref_weights), "copies: weights differ from ops/gate.py"
    assert torch.equal(choice.gather(1, ids), choice.gather(1, ref_ids)), "copies: choice scores differ"
    assert _close(weights, stable_weights), "copies: weights differ from the stable transcription"


def check_gate_edges() -> None:
    """Zero tokens (no launch) and the reference's errors for bad configurations."""
    kmod = _kernel_module()

    with launches(kmod._moe_gate_kernel) as calls:
        weights, ids = kmod.moe_gate(torch.zeros(0, 16), None, 2, 4, 2, True, 1.0)
    assert weights.shape == (0, 2) and ids.shape == (0, 2) and ids.dtype == torch.int64 and not calls
    logits = torch.zeros(3, 16)
    for bad in ((0, 4, 2), (17, 4, 2), (2, 3, 1), (2, 4, 0), (9, 4, 2)):
        try:
            kmod.moe_gate(logits, None, *bad, True, 1.0)
        except ValueError:
            continue
        raise AssertionError(f"(top_k, n_group, topk_group) = {bad} did not raise ValueError")


CHECKS = (check_gate_matches_reference, check_gate_input_layouts, check_gate_ties, check_gate_edges)


results, test_kernel_check = subprocess_checks("tests.test_kernels_gate", CHECKS)


if __name__ == "__main__":
    print(json.dumps(run_checks(CHECKS)))
