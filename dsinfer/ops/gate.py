"""DeepSeek-V3 MoE gate (``noaux_tc`` top-k with group limit): torch reference.

``s = sigmoid(logits)``; choice scores ``c = s + bias`` (the bias only steers selection); the
``E`` experts form ``n_group`` contiguous groups whose score is the sum of their top-2 choice
scores; the best ``topk_group`` groups stay and the others are masked with ``-inf`` (not 0.0:
choice scores can be negative when biases are); ``top_k`` experts are picked from the masked choice
scores; the weights are the UNBIASED ``s`` at those experts, normalised to sum 1 (+1e-20) when
``norm_topk_prob``, then multiplied by ``routed_scaling_factor``.
"""

from __future__ import annotations

import torch

__all__ = ["check_gate", "moe_gate"]


def check_gate(num_experts: int, top_k: int, n_group: int, topk_group: int) -> None:
    """Raise ValueError when the gate's configuration cannot route ``num_experts`` experts."""
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    if n_group < 1 or num_experts % n_group:
        raise ValueError(f"n_experts ({num_experts}) must be divisible by n_group ({n_group})")
    if n_group > 1 and topk_group < n_group:
        if topk_group < 1:
            raise ValueError(f"topk_group must be >= 1, got {topk_group}")
        per_group = num_experts // n_group
        if top_k > topk_group * per_group:
            raise ValueError(f"top_k ({top_k}) exceeds the experts in {topk_group} groups of {per_group}")


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

    Ids are ordered by descending choice score.
    """
    num_tokens, num_experts = router_logits.shape
    check_gate(num_experts, top_k, n_group, topk_group)
    scores = router_logits.float().sigmoid()
    choice = scores if bias is None else scores + bias.float()[None, :]
    if n_group > 1 and topk_group < n_group:
        per_group = num_experts // n_group
        grouped = choice.view(num_tokens, n_group, per_group)
        group_scores = grouped.topk(min(2, per_group), dim=-1).values.sum(dim=-1)  # [T, n_group]
        keep_groups = group_scores.topk(topk_group, dim=-1).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep_groups, True)
        expert_mask = group_mask[:, :, None].expand(-1, -1, per_group).reshape(num_tokens, num_experts)
        choice = choice.masked_fill(~expert_mask, float("-inf"))
    topk_ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, topk_ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, topk_ids
