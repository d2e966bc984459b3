"""DeepSeek-V4's mixture of experts: one shared expert and ``num_experts_per_tok`` routed ones.

The gate scores experts by ``sqrt(softplus(x Wg))`` (or sigmoid/softmax), picks the top ones by
score plus a correction bias (``noaux_tc`` without groups), or, in hash layers, by a fixed table
``tid2eid[token id]``; the picks' scores, normalised to sum 1, times ``routed_scaling_factor``
weigh their outputs. Every SwiGLU (shared and routed) clamps its gate from above and its up
projection on both sides at ``swiglu_limit``.

In an expert-parallel pool (``ep``) a rank holds only its slots of the placement
(``local_experts``); the gate runs where the tokens are (a hash layer reads their ids there), the
(token, expert) pairs travel to the ranks holding a replica of their expert and back, and each
token sums its pairs' outputs under their weights.

With ``mxfp4`` the routed experts stay as the release packs them (e2m1 bytes, an e8m0 scale per
32 values: dsinfer/ops/mxfp4.py) and run through ``ops.mxfp4_grouped_gemm`` over all of a step's
(token, expert) pairs at once; otherwise they are dequantised at load and run expert by expert.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dsinfer.base.v4_config import V4Config
from dsinfer.model.layers import Linear
from dsinfer.model.moe import ExpertParallel, Received, pair_tokens
from dsinfer.ops import Ops
from dsinfer.ops.mxfp4 import MX_BLOCK
from dsinfer.parallel.ep import Pending


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
    def __init__(
        self, config: V4Config, ops: Ops, layer: int, ep: ExpertParallel | None = None, mxfp4: bool = False
    ) -> None:
        super().__init__()
        self.limit, self.ep, self.layer_id = config.swiglu_limit, ep, layer
        experts, hidden, inner = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.local_experts = (
            ep.placement.local_experts(layer, ep.rank) if ep is not None else list(range(experts))
        )
        slots = len(self.local_experts)
        self.gate = V4Gate(config, hashed=config.is_hash_layer(layer))
        self.ops, self.mxfp4 = ops, mxfp4
        if mxfp4:  # packed bytes and scales, as the release stores them
            self.w13 = _frozen(torch.zeros(slots, 2 * inner, hidden // 2, dtype=torch.uint8))  # gate; up
            self.w13_scale = _frozen(torch.zeros(slots, 2 * inner, hidden // MX_BLOCK, dtype=torch.uint8))
            self.w2 = _frozen(torch.zeros(slots, hidden, inner // 2, dtype=torch.uint8))
            self.w2_scale = _frozen(torch.zeros(slots, hidden, inner // MX_BLOCK, dtype=torch.uint8))
        else:
            self.w13 = _frozen(torch.zeros(slots, 2 * inner, hidden))  # gate; up
            self.w2 = _frozen(torch.zeros(slots, hidden, inner))
        self.shared_experts = ClampedMLP(hidden, inner, self.limit, ops)
        self.register_buffer("expert_load", torch.zeros(experts, dtype=torch.int64), persistent=False)
        if ep is not None:
            replica_slots, num_replicas = ep.placement.routing_table(layer)
            self.register_buffer("replica_slots", replica_slots, persistent=False)
            self.register_buffer("num_replicas", num_replicas, persistent=False)

    @property
    def expert_tensor_names(self) -> tuple[str, ...]:
        """The routed experts' tensors, one row per slot."""
        return ("w13", "w2", "w13_scale", "w2_scale") if self.mxfp4 else ("w13", "w2")

    def install(
        self, ep: ExpertParallel, staged: tuple[list[int], dict[str, torch.Tensor]] | None
    ) -> list[torch.Tensor]:
        """Route by ``ep``'s placement from now on; ``staged``: the slots' experts and their
        tensors where they change (None: the same experts stay). Returns the replaced tensors."""
        replaced: list[torch.Tensor] = []
        if staged is not None:
            self.local_experts, tensors = staged
            for name in self.expert_tensor_names:
                replaced.append(getattr(self, name))
                setattr(self, name, _frozen(tensors[name]))
        replica_slots, num_replicas = ep.placement.routing_table(self.layer_id)
        device = self.expert_load.device
        self.register_buffer("replica_slots", replica_slots.to(device), persistent=False)
        self.register_buffer("num_replicas", num_replicas.to(device), persistent=False)
        self.ep = ep
        return replaced

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        if self.ep is None:
            weights, ids = self._route(x, token_ids)
            return self._local(x, weights, ids) + self.shared_experts(x)
        work = self.begin(x, token_ids)
        self.run_experts(work, work.dispatch.wait())
        assert work.combine is not None
        return self.end(work, work.combine.wait()) + self.shared_experts(x)

    def _route(self, x: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = self.gate(x, token_ids)
        self.expert_load += torch.bincount(ids.flatten(), minlength=self.expert_load.shape[0])
        return weights, ids

    def _expert(self, slot: int, rows: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(rows, self.w13[slot].to(rows.dtype)).chunk(2, dim=-1)
        return F.linear(clamped_swiglu(gate, up, self.limit), self.w2[slot].to(rows.dtype))

    def _packed(self, rows: torch.Tensor, slot_of_row: torch.Tensor) -> torch.Tensor:
        """Rows through the packed experts of their slots: two grouped MXFP4 GEMMs around the
        clamped SwiGLU."""
        gemm = self.ops.mxfp4_grouped_gemm
        gate, up = gemm(rows, self.w13, self.w13_scale, slot_of_row).chunk(2, dim=-1)
        return gemm(clamped_swiglu(gate, up, self.limit), self.w2, self.w2_scale, slot_of_row)

    def _local(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self.mxfp4:
            return _summed(self._packed(x[pair_tokens(ids)], ids.flatten()), weights, x)
        routed = torch.zeros_like(x)
        for expert in ids.unique().tolist():
            rows, slot = (ids == expert).nonzero(as_tuple=True)
            out = self._expert(expert, x[rows])
            routed.index_add_(0, rows, (out * weights[rows, slot, None]).to(x.dtype))
        return routed

    # Expert parallelism, in stages (two micro-batches interleave them: dsinfer/model/v4_overlap.py)
    def begin(self, x: torch.Tensor, token_ids: torch.Tensor) -> V4Routed:
        """Route ``x`` and post the dispatch of its (token, expert) pairs, each to a replica of
        its expert (a token's pairs and consecutive tokens spread over the replicas)."""
        assert self.ep is not None
        weights, ids = self._route(x, token_ids)
        tokens, k = ids.shape
        pair_token = pair_tokens(ids)
        experts = ids.flatten()
        spread = pair_token + torch.arange(k, device=x.device).repeat(tokens)
        physical = self.replica_slots[experts, spread % self.num_replicas[experts]]
        per_rank = len(self.local_experts)
        dispatch = self.ep.group.dispatch_async(x[pair_token], physical // per_rank, physical % per_rank)
        return V4Routed(x, weights, dispatch)

    def run_experts(self, work: V4Routed, received: Received) -> None:
        """The pairs this rank received through its slots; posts their combine."""
        assert self.ep is not None
        rows, slots, handle = received
        if self.mxfp4:
            out = self._packed(rows, slots)
        else:
            out = torch.zeros_like(rows)
            for slot in slots.unique().tolist():
                picked = (slots == slot).nonzero(as_tuple=True)[0]
                out[picked] = self._expert(slot, rows[picked]).to(out.dtype)
        work.combine = self.ep.group.combine_async(out, handle)

    def end(self, work: V4Routed, combined: torch.Tensor) -> torch.Tensor:
        """Each token's pairs, back, weighted and summed [T, H] (the shared expert apart)."""
        return _summed(combined, work.weights, work.x)


def _summed(pairs: torch.Tensor, weights: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Each token's k pair outputs (token-major) weighted and summed in float32, in ``like``'s dtype."""
    tokens, k = weights.shape
    out = pairs.view(tokens, k, like.shape[-1]).float() * weights.float().unsqueeze(-1)
    return out.sum(dim=1).to(like.dtype)


def _frozen(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


@dataclass
class V4Routed:
    """One micro-batch's routed experts of one layer, between the gate and the weighted sum."""

    x: torch.Tensor  # the MoE input [T, H]
    weights: torch.Tensor  # [T, k]
    dispatch: Pending[Received]
    combine: Pending[torch.Tensor] | None = None
