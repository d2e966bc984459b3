"""DeepSeekMoE: the noaux_tc router, routed experts through the grouped GEMM, shared experts.

Experts are held stacked per rank: slot s of ``w13`` ([S, 2I, H], gate rows then up rows) and
``w2`` ([S, H, I]) holds logical expert ``expert_ids[s]``. Today every rank hosts every expert
once; expert parallelism later gives each rank its own subset (and redundant copies).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from dsinfer.base.config import FP8_BLOCK, ModelConfig
from dsinfer.model.layers import MLP
from dsinfer.ops import Ops


class Gate(nn.Module):
    def __init__(self, config: ModelConfig, ops: Ops) -> None:
        super().__init__()
        self.ops = ops
        self.top_k, self.n_group, self.topk_group = (
            config.num_experts_per_tok,
            config.n_group,
            config.topk_group,
        )
        self.norm_topk_prob, self.scale = config.norm_topk_prob, config.routed_scaling_factor
        self.weight = nn.Parameter(
            torch.empty(config.n_routed_experts, config.hidden_size), requires_grad=False
        )
        self.e_score_correction_bias = nn.Parameter(
            torch.zeros(config.n_routed_experts, dtype=torch.float32), requires_grad=False
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (weights fp32 [T, k], logical expert ids int64 [T, k])."""
        router_logits = F.linear(x.float(), self.weight.float())
        return self.ops.moe_gate(
            router_logits,
            self.e_score_correction_bias,
            self.top_k,
            self.n_group,
            self.topk_group,
            self.norm_topk_prob,
            self.scale,
        )


class Experts(nn.Module):
    def __init__(self, config: ModelConfig, ops: Ops, expert_ids: list[int]) -> None:
        super().__init__()
        self.ops = ops
        self.hidden, self.inter = config.hidden_size, config.moe_intermediate_size
        self.expert_ids = list(expert_ids)
        slots = len(self.expert_ids)
        self.w13 = nn.Parameter(torch.empty(slots, 2 * self.inter, self.hidden), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(slots, self.hidden, self.inter), requires_grad=False)
        self.w13_scale_inv: nn.Parameter | None = None
        self.w2_scale_inv: nn.Parameter | None = None
        # Computed buffers are built on the CPU even when parameters are built on "meta".
        slot_of = torch.full((config.n_routed_experts,), -1, dtype=torch.int64, device="cpu")
        slot_of[torch.tensor(self.expert_ids, dtype=torch.int64, device="cpu")] = torch.arange(
            slots, device="cpu"
        )
        self.register_buffer("slot_of_expert", slot_of, persistent=False)

    def make_fp8(self) -> None:
        device, slots = self.w13.device, len(self.expert_ids)

        def blocks(n: int) -> int:
            return math.ceil(n / FP8_BLOCK)

        fp8 = torch.float8_e4m3fn
        self.w13 = nn.Parameter(self.w13.new_empty(self.w13.shape, dtype=fp8), requires_grad=False)
        self.w2 = nn.Parameter(self.w2.new_empty(self.w2.shape, dtype=fp8), requires_grad=False)
        # gate and up stack into whole 128-row blocks: the config requires moe_intermediate_size % 128 == 0.
        w13_scale = (slots, blocks(2 * self.inter), blocks(self.hidden))
        self.w13_scale_inv = nn.Parameter(torch.empty(w13_scale, device=device), requires_grad=False)
        w2_scale = (slots, blocks(self.hidden), blocks(self.inter))
        self.w2_scale_inv = nn.Parameter(torch.empty(w2_scale, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """Weighted sum over each token's routed experts, x: [T, H] -> [T, H]."""
        out = torch.zeros_like(x)
        if x.shape[0] == 0:
            return out
        slots = self.slot_of_expert[topk_ids].flatten()  # [T * k]
        order = torch.argsort(slots, stable=True)
        rows = order // topk_ids.shape[1]  # token of each sorted (token, expert) pair
        m_indices = slots[order].to(torch.int32)
        gate_up = self.ops.grouped_gemm_contiguous(x[rows], self.w13, self.w13_scale_inv, m_indices)
        gate, up = gate_up.chunk(2, dim=-1)
        y = self.ops.grouped_gemm_contiguous(F.silu(gate) * up, self.w2, self.w2_scale_inv, m_indices)
        weights = topk_weights.flatten()[order].to(y.dtype)
        return out.index_add_(0, rows, y * weights[:, None])


class MoE(nn.Module):
    def __init__(self, config: ModelConfig, ops: Ops, expert_ids: list[int] | None = None) -> None:
        super().__init__()
        self.gate = Gate(config, ops)
        ids = list(range(config.n_routed_experts)) if expert_ids is None else expert_ids
        self.experts = Experts(config, ops, ids)
        self.shared_experts = (
            MLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts, ops)
            if config.n_shared_experts > 0
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.gate(x)
        y = self.experts(x, topk_weights, topk_ids)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y
