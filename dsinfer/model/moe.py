"""DeepSeekMoE: the noaux_tc router, routed experts through the grouped GEMM, shared experts.

Experts are held stacked per rank: slot s of ``w13`` ([S, 2I, H], gate rows then up rows) and
``w2`` ([S, H, I]) holds logical expert ``expert_ids[s]``. Without expert parallelism one rank
hosts every expert. With it (``ExpertParallel``), a rank hosts the slots the placement gives it;
each (token, expert) pair picks one replica of its logical expert, travels to the rank hosting
that physical slot (``EPGroup.dispatch``), is computed there and comes back (``combine``) to be
weighted and summed at its token. Counters record the tokens routed to each logical expert (the
input of EPLB) and those computed in each local slot.

The routed path runs in three steps that a micro-batch schedule may interleave with other work:
``begin`` (gate, dispatch posted), ``run_experts`` (the received rows through the local experts,
combine posted) and ``routed_sum`` (the weighted sum of the combined results); ``forward`` runs
them back to back. Without expert parallelism the transfers are completed ``Pending``s.

Two layouts compute the routed experts, with equal results:

- grouped by slot (``Experts.compute``, the default): ``ops.fused_experts``, i.e. the fused CPU
  kernel or the pairs sorted by slot through two ``grouped_gemm_contiguous`` calls (DeepGEMM's
  contiguous layout). Sorting and the per-expert counts are read on the host.
- masked (``Experts.compute_masked``, ``begin(..., masked=True)``): pairs scattered into
  ``[slots, capacity, H]`` at ranks computed on the device, ``ops.masked_experts`` (two masked
  grouped GEMMs whose FP8 inputs are quantized over the valid rows only) with the per-expert
  counts ``masked_m`` on the device, gathered back. Nothing is read on the host, so a
  CUDA graph can capture it (the decode step, dsinfer/engine/cuda_graph.py). It is the layout
  DeepEP's low-latency dispatch delivers; with expert parallelism today's dispatch (pair rows over
  ``EPGroup.dispatch``) still syncs to the host, so CUDA graphs stay off there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dsinfer.base.config import FP8_BLOCK, ModelConfig
from dsinfer.model.layers import MLP
from dsinfer.ops import Ops
from dsinfer.parallel.ep import DispatchHandle, EPGroup, Pending
from dsinfer.parallel.placement import ExpertPlacement


@dataclass(frozen=True)
class ExpertParallel:
    """This rank's part in an expert-parallel group."""

    placement: ExpertPlacement
    group: EPGroup

    @property
    def rank(self) -> int:
        return self.group.rank


# rows, local slots (one per pair), handle; without expert parallelism the rows are the tokens'
# (``RoutedWork.pairs_per_row`` pairs each), after a dispatch one row per pair
Received = tuple[torch.Tensor, torch.Tensor, DispatchHandle | None]


@dataclass
class RoutedWork:
    """One micro-batch's routed experts of one MoE layer, between the gate and the weighted sum."""

    x: torch.Tensor  # the MoE input [T, H]
    topk_weights: torch.Tensor  # [T, k]
    dispatch: Pending[Received]
    combine: Pending[torch.Tensor] | None = None  # posted by MoE.run_experts
    masked: bool = False  # run_experts uses the masked layout (graph-safe)
    pairs_per_row: int = 1  # the pairs each received row stands for (k: the tokens themselves)


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
        self.register_buffer(
            "slot_load", torch.zeros(slots, dtype=torch.int64, device="cpu"), persistent=False
        )

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
        """Weighted sum over each token's routed experts, all hosted here, x: [T, H] -> [T, H]."""
        y = self.compute(x, self.slot_of_expert[topk_ids].flatten(), topk_ids.shape[1])
        return _weighted_sum(y, topk_weights)

    def compute(self, rows: torch.Tensor, slots: torch.Tensor, pairs_per_row: int = 1) -> torch.Tensor:
        """Each (row, slot) pair through the expert in its local slot, pair ``p`` reading row
        ``p // pairs_per_row``: [M, H] -> [M * pairs_per_row, H], in the pairs' order."""
        self.slot_load += torch.bincount(slots, minlength=len(self.expert_ids))
        if rows.shape[0] == 0:
            return rows.new_zeros((0, self.hidden))
        return self.ops.fused_experts(
            rows, slots, self.w13, self.w13_scale_inv, self.w2, self.w2_scale_inv, pairs_per_row
        )

    def compute_masked(
        self, rows: torch.Tensor, slots: torch.Tensor, capacity: int | None = None
    ) -> torch.Tensor:
        """``compute`` in the masked layout, with no host synchronisation: [M, H] -> [M, H].

        A row whose slot is negative is skipped (its output is zero). ``capacity`` bounds the rows
        of any one slot (default M; the tokens of a batch, each routed to a slot at most once)."""
        num_slots, m = len(self.expert_ids), rows.shape[0]
        capacity = m if capacity is None else capacity
        if m == 0 or capacity == 0:
            return rows.new_zeros((m, self.hidden))
        layout = masked_layout(slots, num_slots)
        self.slot_load += layout.masked_m
        # one trash plane past the last slot receives the skipped rows; rows past masked_m are
        # never read (the GEMMs skip them, the gather below never selects them): no zero fill.
        # The capacity is rounded here to the rows the GEMMs take unpadded: no copy per layer.
        alignment = self.ops.masked_m_alignment
        packed = rows.new_empty((num_slots + 1, -(-capacity // alignment) * alignment, self.hidden))
        packed[layout.slot, layout.rank] = rows
        expected_m = max(1, -(-m // num_slots))  # host-side hint: the mean rows per slot
        masked_m = layout.masked_m.to(torch.int32)
        y = self.ops.masked_experts(
            packed[:num_slots], self.w13, self.w13_scale_inv, self.w2, self.w2_scale_inv, masked_m, expected_m
        )
        # rows past masked_m are undefined (never read): a skipped row selects zero, not y's value
        picked = y[layout.slot.clamp(max=num_slots - 1), layout.rank]
        return torch.where(layout.valid[:, None], picked, 0.0).to(rows.dtype)


@dataclass(frozen=True)
class MaskedLayout:
    """Where each row goes in a masked ``[slots (+1 trash), capacity, H]`` layout."""

    slot: torch.Tensor  # int64 [M]: the row's slot, ``num_slots`` (the trash plane) when skipped
    rank: torch.Tensor  # int64 [M]: arrival order among the rows of its slot
    valid: torch.Tensor  # bool [M]
    masked_m: torch.Tensor  # int64 [num_slots]: rows per slot


def masked_layout(slots: torch.Tensor, num_slots: int) -> MaskedLayout:
    """Device-side ranks of rows within their slot (a negative slot = skipped), no host sync:
    a running count per slot over a [M, num_slots + 1] comparison (M x slots is small at decode)."""
    valid = (slots >= 0) & (slots < num_slots)
    slot = torch.where(valid, slots, num_slots).long()
    hit = slot[:, None] == torch.arange(num_slots + 1, device=slots.device)[None, :]
    running = hit.long().cumsum(0)  # [M, slots + 1]: rows of each slot so far, this one included
    # skipped rows all land on row 0 of the trash plane (however many they are)
    rank = torch.where(valid, running.gather(1, slot[:, None]).squeeze(1) - 1, 0)
    return MaskedLayout(slot, rank, valid, running[-1, :num_slots])


def pair_tokens(topk_ids: torch.Tensor) -> torch.Tensor:
    """The token of each flattened (token, k) pair."""
    tokens, k = topk_ids.shape
    return torch.arange(tokens, device=topk_ids.device).repeat_interleave(k)


def _weighted_sum(y: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """Each token's k expert outputs weighted and summed (pairs are token-major, k per token)."""
    tokens, k = topk_weights.shape
    weights = topk_weights.to(y.dtype).unsqueeze(-1)
    return (y.view(tokens, k, y.shape[-1]) * weights).sum(dim=1)


class MoE(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        ops: Ops,
        layer_id: int,
        expert_ids: list[int] | None = None,
        ep: ExpertParallel | None = None,
    ) -> None:
        super().__init__()
        self.gate = Gate(config, ops)
        self.layer_id = layer_id
        self.ep: ExpertParallel | None = None
        if ep is not None:
            expert_ids = ep.placement.local_experts(layer_id, ep.rank)
            self.set_placement(ep)
        ids = list(range(config.n_routed_experts)) if expert_ids is None else expert_ids
        self.experts = Experts(config, ops, ids)
        self.register_buffer(
            "expert_load",
            torch.zeros(config.n_routed_experts, dtype=torch.int64, device="cpu"),
            persistent=False,
        )
        self.shared_experts = (
            MLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts, ops)
            if config.n_shared_experts > 0
            else None
        )

    def set_placement(self, ep: ExpertParallel) -> None:
        """Route by ``ep``'s placement (its local experts must be the ones ``experts`` holds)."""
        replica_slots, num_replicas = ep.placement.routing_table(self.layer_id)
        device = self.expert_load.device if hasattr(self, "expert_load") else torch.device("cpu")
        self.register_buffer("replica_slots", replica_slots.to(device), persistent=False)
        self.register_buffer("num_replicas", num_replicas.to(device), persistent=False)
        self.slots_per_rank = ep.placement.slots_per_rank
        self.ep = ep

    def forward(
        self, x: torch.Tensor, *, token_mask: torch.Tensor | None = None, masked: bool = False
    ) -> torch.Tensor:
        work = self.begin(x, token_mask=token_mask, masked=masked)
        self.run_experts(work, work.dispatch.wait())
        assert work.combine is not None
        y = self.routed_sum(work, work.combine.wait())
        shared = self.shared(x)
        return y if shared is None else y + shared

    def begin(
        self, x: torch.Tensor, *, token_mask: torch.Tensor | None = None, masked: bool = False
    ) -> RoutedWork:
        """Route ``x`` [T, H] and post the dispatch of its (token, expert) pairs.

        ``masked``: the graph-safe path (device-side counts, masked expert layout); tokens where
        ``token_mask`` is False (padding rows of a captured batch) count no load and reach no
        expert. Both need this rank to host every expert (no expert parallelism)."""
        if token_mask is not None and not masked:
            raise ValueError("token_mask is read by the masked routed path only")
        topk_weights, topk_ids = self.gate(x)
        experts = topk_ids.flatten()
        local: Pending[Received]
        if masked:
            if self.ep is not None:
                raise ValueError(
                    "the masked (graph-safe) routed path runs without expert parallelism: the EP "
                    "dispatch of pair rows reads row counts on the host"
                )
            pair_token = pair_tokens(topk_ids)
            valid = (
                token_mask[pair_token]
                if token_mask is not None
                else torch.ones_like(experts, dtype=torch.bool)
            )
            self.expert_load.index_add_(0, experts, valid.long())
            slots = torch.where(valid, self.experts.slot_of_expert[experts], -1)
            local = Pending.completed((x[pair_token], slots, None))
            return RoutedWork(x, topk_weights, local, masked=masked)
        self.expert_load += torch.bincount(experts, minlength=self.expert_load.shape[0])
        if self.ep is None:  # the experts read each token's row for its k pairs
            local = Pending.completed((x, self.experts.slot_of_expert[experts], None))
            return RoutedWork(x, topk_weights, local, pairs_per_row=topk_ids.shape[1])
        pair_token = pair_tokens(topk_ids)
        # spread a token's pairs and consecutive tokens over the replicas of their expert
        spread = pair_token + torch.arange(topk_ids.shape[1], device=x.device).repeat(topk_ids.shape[0])
        physical = self.replica_slots[experts, spread % self.num_replicas[experts]]
        dispatch = self.ep.group.dispatch_async(
            x[pair_token], physical // self.slots_per_rank, physical % self.slots_per_rank
        )
        return RoutedWork(x, topk_weights, dispatch)

    def run_experts(self, work: RoutedWork, received: Received) -> None:
        """The rows this rank received through its experts; posts their combine."""
        rows, slots, handle = received
        if work.masked:
            y = self.experts.compute_masked(rows, slots, capacity=work.x.shape[0])
        else:
            y = self.experts.compute(rows, slots, work.pairs_per_row)
        if handle is None:
            work.combine = Pending.completed(y)
        else:
            assert self.ep is not None
            work.combine = self.ep.group.combine_async(y, handle)

    def routed_sum(self, work: RoutedWork, combined: torch.Tensor) -> torch.Tensor:
        """Each token's weighted sum over its routed experts' results [T, H]."""
        return _weighted_sum(combined, work.topk_weights)

    def shared(self, x: torch.Tensor) -> torch.Tensor | None:
        return self.shared_experts(x) if self.shared_experts is not None else None
