"""Index bookkeeping between dsinfer's pair-level expert rows and DeepEP's token-level and masked
layouts, and the sizes a DeepEP buffer needs. Pure functions on any device (no DeepEP): what the
CPU tests hold of the DeepEP backend (dsinfer/parallel/deepep.py, tests/test_deepep_adapter.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from dsinfer.parallel.ep import EPGroup

__all__ = [
    "DEFAULT_QP_DEPTH",
    "FP8_GROUP",
    "compute_received_tokens",
    "dequantize_fp8_rows",
    "expand_received",
    "is_token_in_rank",
    "low_latency_qp_depth",
    "pack_masked",
    "pair_expert_ids",
    "qp_depth_to_set",
    "reduce_to_tokens",
    "round_slices",
    "routed_pairs",
    "split_expert_ids",
    "token_send_plan",
    "unpack_masked",
]

FP8_GROUP = 128  # DeepEP's FP8 scales: one fp32 per 128 channels of a row
# DeepEP's legacy buffer sets NVSHMEM_QP_DEPTH to this when the environment does not, and asserts
# ``depth >= 2 * (num_max_dispatch_tokens_per_rank + 1)`` at every low-latency dispatch and combine.
DEFAULT_QP_DEPTH = 1024

Compute = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (rows [Q, H], local slots [Q]) -> [Q, H]


def low_latency_qp_depth(max_tokens_per_rank: int) -> int:
    """The NVSHMEM queue-pair depth DeepEP's low-latency kernels need for this many tokens per rank."""
    return 2 * (max_tokens_per_rank + 1)


def qp_depth_to_set(max_tokens_per_rank: int, env: Mapping[str, str]) -> int | None:
    """The ``NVSHMEM_QP_DEPTH`` to put in the environment before the buffer is built, or None when
    the configured one (``env``, else DeepEP's default 1024) suffices. A value the operator set
    that is too small raises, naming the variable and the depth needed."""
    needed = low_latency_qp_depth(max_tokens_per_rank)
    given = env.get("NVSHMEM_QP_DEPTH")
    if given is not None:
        if int(given) < needed:
            raise ValueError(
                f"NVSHMEM_QP_DEPTH={given} is below the {needed} that DeepEP's low-latency mode needs "
                f"for {max_tokens_per_rank} tokens per rank (2 x (tokens + 1)); raise it or lower "
                "max_num_seqs"
            )
        return None
    return needed if needed > DEFAULT_QP_DEPTH else None


def round_slices(rows: int, capacity: int, rounds: int) -> list[slice]:
    """``rows`` split into exactly ``rounds`` consecutive slices of at most ``capacity`` rows
    (trailing ones empty): every rank runs the same number of low-latency rounds."""
    if rows > capacity * rounds:
        raise ValueError(f"{rows} rows do not fit {rounds} rounds of {capacity}")
    return [slice(min(i * capacity, rows), min((i + 1) * capacity, rows)) for i in range(rounds)]


def pair_expert_ids(
    dest_rank: torch.Tensor, local_slot: torch.Tensor, num_local_experts: int
) -> torch.Tensor:
    """Pair rows as DeepEP tokens routed top-1: the physical expert id of each row, int64 ``[P, 1]``."""
    return (dest_rank.to(torch.int64) * num_local_experts + local_slot.to(torch.int64)).reshape(-1, 1)


def split_expert_ids(expert_ids: torch.Tensor, num_local_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Physical expert ids -> (hosting rank, local slot); -1 (no expert) stays -1 in both."""
    valid = expert_ids >= 0
    rank = torch.where(valid, expert_ids // num_local_experts, -1)
    local = torch.where(valid, expert_ids % num_local_experts, -1)
    return rank, local


def is_token_in_rank(topk_idx: torch.Tensor, num_local_experts: int, num_ranks: int) -> torch.Tensor:
    """``get_dispatch_layout``'s ``is_token_in_rank``: bool ``[N, R]``, token n has an expert on rank r."""
    dest, _ = split_expert_ids(topk_idx, num_local_experts)
    ranks = torch.arange(num_ranks, device=topk_idx.device)
    return (dest[:, :, None] == ranks).any(dim=1)


def token_send_plan(
    topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_local_experts: int, num_ranks: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a normal-mode dispatch sends from this rank: one row per (token, destination rank).

    ``topk_idx`` int64 ``[N, k]`` physical expert ids (-1 = none), ``topk_weights`` ``[N, k]``.
    Returns ``(token [Q], rank [Q], local_ids [Q, k], weights [Q, k])`` ordered by destination
    rank, then token: row q carries token ``token[q]`` to ``rank[q]``, where it arrives with the
    LOCAL ids of the experts it has there (-1 for experts elsewhere, with weight 0).
    """
    dest, _ = split_expert_ids(topk_idx, num_local_experts)
    pairs = is_token_in_rank(topk_idx, num_local_experts, num_ranks).t().nonzero()  # rank-major
    rank, token = pairs[:, 0], pairs[:, 1]
    here = dest[token] == rank[:, None]
    local_ids = torch.where(here, topk_idx[token] - rank[:, None] * num_local_experts, -1)
    weights = torch.where(here, topk_weights[token], 0.0)
    return token, rank, local_ids, weights


def expand_received(
    recv_local_ids: torch.Tensor, recv_weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Received tokens -> the pair rows computed here: ``(row_token [Q], row_slot [Q], row_weight [Q])``.

    One row per valid (received token, local expert), token-major, so ``recv_x[row_token]`` with
    ``row_slot`` is exactly what ``Experts.compute`` takes.
    """
    token, j = (recv_local_ids >= 0).nonzero(as_tuple=True)
    return token, recv_local_ids[token, j], recv_weights[token, j]


def reduce_to_tokens(
    y: torch.Tensor, row_token: torch.Tensor, row_weight: torch.Tensor, num_tokens: int
) -> torch.Tensor:
    """Weighted sum of the rows' results per received token (float32 accumulation): ``[M, H]``."""
    out = torch.zeros((num_tokens, y.shape[-1]), dtype=torch.float32, device=y.device)
    out.index_add_(0, row_token, y.float() * row_weight.float()[:, None])
    return out.to(y.dtype)


def compute_received_tokens(
    recv_x: torch.Tensor, recv_local_ids: torch.Tensor, recv_weights: torch.Tensor, compute: Compute
) -> torch.Tensor:
    """Normal-mode receive side: each received token's weighted sum over its local experts ``[M, H]``,
    ready for DeepEP's unweighted combine."""
    token, slot, weight = expand_received(recv_local_ids, recv_weights)
    return reduce_to_tokens(compute(recv_x[token], slot), token, weight, recv_x.shape[0])


def unpack_masked(recv_count: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The valid rows of a masked ``[E_local, capacity, H]`` layout: ``(flat_index [Q], slot [Q])``.

    Row ``i < recv_count[e]`` of expert ``e`` is flat row ``e * capacity + i``; expert-major, then
    arrival order. Reads ``recv_count`` on the host once (not CUDA-graph friendly).
    """
    counts = recv_count.to(torch.int64).clamp(0, capacity)
    total = int(counts.sum())
    experts = torch.arange(counts.numel(), device=counts.device)
    slot = torch.repeat_interleave(experts, counts, output_size=total)
    starts = torch.cumsum(counts, 0) - counts
    offset = torch.arange(total, device=counts.device) - starts[slot]
    return slot * capacity + offset, slot


def pack_masked(
    y: torch.Tensor, flat_index: torch.Tensor, num_local_experts: int, capacity: int
) -> torch.Tensor:
    """Inverse of :func:`unpack_masked`: rows ``[Q, H]`` into a zero ``[E_local, capacity, H]`` layout."""
    out = y.new_zeros((num_local_experts * capacity, y.shape[-1]))
    out.index_copy_(0, flat_index, y)
    return out.view(num_local_experts, capacity, y.shape[-1])


def dequantize_fp8_rows(q: torch.Tensor, scales: torch.Tensor, group: int = FP8_GROUP) -> torch.Tensor:
    """fp8 ``[..., H]`` with fp32 scales ``[..., ceil(H/group)]`` -> float32 (scale layout may be any)."""
    hidden = q.shape[-1]
    return q.float() * scales.float().repeat_interleave(group, dim=-1)[..., :hidden]


def routed_pairs(
    group: EPGroup,
    x: torch.Tensor,
    topk_physical: torch.Tensor,
    topk_weights: torch.Tensor,
    compute: Compute,
    num_local_experts: int,
) -> torch.Tensor:
    """Pair-level routing over any ``EPGroup`` (what ``MoE._routed_ep`` does once replicas are chosen).

    ``topk_physical`` int64 ``[T, k]`` physical slots (every entry valid), ``num_local_experts``
    the slots per rank; returns the weighted sums ``[T, H]`` in x's dtype.
    """
    tokens, k = topk_physical.shape
    pair_token = torch.arange(tokens, device=x.device).repeat_interleave(k)
    dest, local = split_expert_ids(topk_physical.flatten(), num_local_experts)
    rows, slots, handle = group.dispatch(x[pair_token], dest, local)
    y = group.combine(compute(rows, slots), handle)
    return reduce_to_tokens(y, pair_token, topk_weights.flatten(), tokens)
