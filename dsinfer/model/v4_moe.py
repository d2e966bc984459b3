"""DeepSeek-V4's mixture of experts: one shared expert and ``num_experts_per_tok`` routed ones.

The gate scores experts by ``sqrt(softplus(x Wg))`` (or sigmoid/softmax), picks the top ones by
score plus a correction bias (``noaux_tc`` without groups), or, in hash layers, by a fixed table
``tid2eid[token id]``; the picks' scores, normalised to sum 1, times ``routed_scaling_factor``
weigh their outputs. Every SwiGLU (shared and routed) clamps its gate from above and its up
projection on both sides at ``swiglu_limit``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsinfer.base.v4_config import V4Config
from dsinfer.model.layers import Linear
from dsinfer.ops import Ops


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


class ClampedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, limit: float | None, ops: Ops) -> None:
        super().__init__()
        self.limit = limit
        self.w1 = Linear(hidden, intermediate, ops)  # gate
        self.w3 = Linear(hidden, intermediate, ops)  # up
        self.w2 = Linear(intermediate, hidden, ops)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(clamped_swiglu(self.w1(x), self.w3(x), self.limit))


class V4Gate(nn.Module):
    def __init__(self, config: V4Config, hashed: bool) -> None:
        super().__init__()
        self.top_k, self.scale, self.scoring = (
            config.num_experts_per_tok,
            config.routed_scaling_factor,
            config.scoring_func,
        )
        self.weight = nn.Parameter(
            torch.zeros(config.n_routed_experts, config.hidden_size), requires_grad=False
        )
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(config.vocab_size, self.top_k, dtype=torch.int64))
        else:
            self.register_buffer("bias", torch.zeros(config.n_routed_experts))
        self.hashed = hashed

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (weights [T, k], expert ids [T, k])."""
        logits = F.linear(x, self.weight.to(x.dtype))
        if self.scoring == "sqrtsoftplus":
            scores = F.softplus(logits).sqrt()
        elif self.scoring == "sigmoid":
            scores = logits.sigmoid()
        else:
            scores = logits.softmax(-1)
        if self.hashed:
            ids = self.tid2eid[token_ids].long()
        else:
            ids = torch.topk(scores + self.bias.to(scores.dtype), self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        return weights / (weights.sum(-1, keepdim=True) + 1e-20) * self.scale, ids


class V4MoE(nn.Module):
    def __init__(self, config: V4Config, ops: Ops, layer: int) -> None:
        super().__init__()
        self.limit = config.swiglu_limit
        experts, hidden, inner = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.gate = V4Gate(config, hashed=config.is_hash_layer(layer))
        self.w13 = nn.Parameter(torch.zeros(experts, 2 * inner, hidden), requires_grad=False)  # gate; up
        self.w2 = nn.Parameter(torch.zeros(experts, hidden, inner), requires_grad=False)
        self.shared_experts = ClampedMLP(hidden, inner, self.limit, ops)
        self.register_buffer("expert_load", torch.zeros(experts, dtype=torch.int64), persistent=False)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x, token_ids)
        self.expert_load += torch.bincount(ids.flatten(), minlength=self.expert_load.shape[0])
        routed = torch.zeros_like(x)
        for expert in ids.unique().tolist():
            rows, slot = (ids == expert).nonzero(as_tuple=True)
            gate, up = F.linear(x[rows], self.w13[expert].to(x.dtype)).chunk(2, dim=-1)
            out = F.linear(clamped_swiglu(gate, up, self.limit), self.w2[expert].to(x.dtype))
            routed.index_add_(0, rows, (out * weights[rows, slot, None]).to(x.dtype))
        return routed + self.shared_experts(x)
