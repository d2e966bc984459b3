"""DeepSeek-V3 ``noaux_tc`` MoE gate as one fused Triton kernel (``dsinfer.ops.gate`` is the reference).

Per token: ``s = sigmoid(logits)``, choice ``c = s + bias`` (selection only); each of ``n_group``
contiguous expert groups scores the sum of its top-2 choices; the best ``topk_group`` groups stay
and the other experts are masked with -inf; ``top_k`` experts are taken by descending choice; the
weights are the unbiased ``s`` there, renormalized (``/ (sum + 1e-20)``) when asked, times
``routed_scaling_factor``. The experts of a token are held as a ``[groups, experts per group]``
tile (both padded to powers of two), so group reductions are row reductions for any group size.

Ties are broken towards the lowest index (group index for groups, expert id for experts), which
is what a stable descending sort gives. ``torch.topk`` leaves the order of equal values
unspecified, so on exact ties the reference may list equal-scored experts in another order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["moe_gate"]


@triton.jit
def _moe_gate_kernel(
    logits_ptr,
    bias_ptr,
    weights_ptr,
    ids_ptr,
    T,
    stride_lt,
    stride_le,
    stride_wt,
    stride_it,
    scaling,
    HAS_BIAS: tl.constexpr,
    N_GROUP: tl.constexpr,
    PER_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    TOP_K: tl.constexpr,
    LIMIT_GROUPS: tl.constexpr,
    NORM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    G_PAD: tl.constexpr,
    P_PAD: tl.constexpr,
    K_PAD: tl.constexpr,
):
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    grp = tl.arange(0, G_PAD)
    pos = tl.arange(0, P_PAD)
    lane = (grp[:, None] < N_GROUP) & (pos[None, :] < PER_GROUP)
    expert = tl.where(lane, grp[:, None] * PER_GROUP + pos[None, :], -1)  # [G, P]; -1 = padding
    tok_ok = tok < T
    ptrs = logits_ptr + tok.to(tl.int64)[:, None, None] * stride_lt + expert[None, :, :] * stride_le
    logits = tl.load(ptrs, mask=tok_ok[:, None, None] & lane[None, :, :], other=0.0).to(tl.float32)
    scores = tl.sigmoid(logits)  # [T, G, P]
    choice = scores
    if HAS_BIAS:
        choice = choice + tl.load(bias_ptr + expert, mask=lane, other=0.0).to(tl.float32)[None, :, :]
    choice = tl.where(lane[None, :, :], choice, float("-inf"))

    if LIMIT_GROUPS:
        top1 = tl.max(choice, axis=2)  # [T, G]
        if PER_GROUP > 1:
            at1 = tl.min(tl.where(choice == top1[:, :, None], pos[None, None, :], P_PAD), axis=2)
            top2 = tl.max(tl.where(pos[None, None, :] == at1[:, :, None], float("-inf"), choice), axis=2)
            group_score = top1 + top2
        else:
            group_score = top1
        keep = tl.zeros((BLOCK_T, G_PAD), dtype=tl.int1)
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.max(group_score, axis=1)
            pick = tl.min(tl.where(group_score == best[:, None], grp[None, :], G_PAD), axis=1)
            taken = grp[None, :] == pick[:, None]
            keep = keep | taken
            group_score = tl.where(taken, float("-inf"), group_score)
        choice = tl.where(keep[:, :, None], choice, float("-inf"))

    col = tl.arange(0, K_PAD)
    weights = tl.zeros((BLOCK_T, K_PAD), dtype=tl.float32)
    ids = tl.zeros((BLOCK_T, K_PAD), dtype=tl.int32)
    num_lanes: tl.constexpr = G_PAD * P_PAD
    for i in tl.static_range(TOP_K):
        best = tl.max(tl.max(choice, axis=2), axis=1)
        pick = tl.min(
            tl.min(tl.where(choice == best[:, None, None], expert[None, :, :], num_lanes), axis=2), axis=1
        )
        taken = expert[None, :, :] == pick[:, None, None]
        picked_score = tl.sum(tl.sum(tl.where(taken, scores, 0.0), axis=2), axis=1)
        weights = tl.where(col[None, :] == i, picked_score[:, None], weights)
        ids = tl.where(col[None, :] == i, pick[:, None], ids)
        choice = tl.where(taken, float("-inf"), choice)
    if NORM:
        total = tl.sum(weights, axis=1) + 1e-20
        weights = tl.math.div_rn(weights, tl.broadcast_to(total[:, None], weights.shape))
    weights = weights * scaling

    out_mask = tok_ok[:, None] & (col[None, :] < TOP_K)
    rows = tok.to(tl.int64)[:, None]
    tl.store(weights_ptr + rows * stride_wt + col[None, :], weights, mask=out_mask)
    tl.store(ids_ptr + rows * stride_it + col[None, :], ids.to(tl.int64), mask=out_mask)


def moe_gate(
    router_logits: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Route ``T`` tokens over ``E`` experts -> ``(weights fp32 [T, top_k], ids int64 [T, top_k])``.

    The signature and results of ``dsinfer.ops.gate.moe_gate``; ids by descending choice score.
    """
    num_tokens, num_experts = router_logits.shape
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    if n_group < 1 or num_experts % n_group:
        raise ValueError(f"n_experts ({num_experts}) must be divisible by n_group ({n_group})")
    per_group = num_experts // n_group
    limit_groups = n_group > 1 and topk_group < n_group
    if limit_groups:
        if topk_group < 1:
            raise ValueError(f"topk_group must be >= 1, got {topk_group}")
        if top_k > topk_group * per_group:
            raise ValueError(f"top_k ({top_k}) exceeds the experts in {topk_group} groups of {per_group}")
    if bias is not None and tuple(bias.shape) != (num_experts,):
        raise ValueError(f"bias must have shape [{num_experts}], got {tuple(bias.shape)}")
    device = router_logits.device
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=device)
    if num_tokens == 0:
        return weights, ids
    g_pad, p_pad = triton.next_power_of_2(n_group), triton.next_power_of_2(per_group)
    block_t = min(16, max(1, 2048 // (g_pad * p_pad)))
    _moe_gate_kernel[(triton.cdiv(num_tokens, block_t),)](
        router_logits, router_logits if bias is None else bias, weights, ids, num_tokens,
        router_logits.stride(0), router_logits.stride(1), weights.stride(0), ids.stride(0),
        float(routed_scaling_factor),
        HAS_BIAS=bias is not None, N_GROUP=n_group, PER_GROUP=per_group,
        TOPK_GROUP=topk_group if limit_groups else n_group, TOP_K=top_k, LIMIT_GROUPS=limit_groups,
        NORM=bool(norm_topk_prob), BLOCK_T=block_t, G_PAD=g_pad, P_PAD=p_pad,
        K_PAD=triton.next_power_of_2(top_k), num_warps=4,
    )  # fmt: skip
    return weights, ids
