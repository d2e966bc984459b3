"""Expert-parallel load balancer (EPLB): per-layer expert load -> placement of physical expert slots.

``rebalance_experts`` follows the semantics of DeepSeek's published EPLB (shared/reference/
kernel-apis.md), written from its description:

- **hierarchical** policy (``num_groups % num_nodes == 0``): (1) pack the expert groups onto the
  nodes, equal group counts per node, heaviest group first into the lightest node with room;
  (2) inside each node, replicate: give one more replica, one at a time, to the node's expert
  with the highest load per replica, until the node's slots are used; (3) pack the node's
  replicas (load = expert load / replicas) onto its ranks the same balanced way.
- **global** policy (otherwise): the same with one group and one node.

Physical slot ``p`` lives on rank ``p // (num_replicas // num_ranks)``. Ties break towards the
lower index everywhere, so the result is a deterministic function of its inputs.

DeepSeek's packing ignores which logical expert a replica belongs to, so two replicas of one
expert can land on one rank (always, when an expert gets more replicas than a node has ranks).
``ExpertPlacement`` forbids that (the rank would run the expert twice for nothing), so
``placement_from_load`` asks for ``one_replica_per_rank``: replication then stops at one replica
per rank of the replication domain (a node, or the pool under the global policy), and a
duplicate left by the packing is swapped with a slot of another rank of the same node (the swap
that keeps the heavier of the two ranks lightest). Without that flag the output is exactly
DeepSeek's.
"""

from __future__ import annotations

import heapq
import math

import torch

from dsinfer.parallel.placement import ExpertPlacement

__all__ = ["placement_from_load", "rebalance_experts"]


def rebalance_experts(
    weight: torch.Tensor,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_ranks: int,
    *,
    one_replica_per_rank: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """EPLB over ``weight`` [layers, num_logical] (load per logical expert, e.g. tokens routed).

    Returns int64 CPU tensors: ``phy2log`` [layers, num_replicas] (the logical expert of each
    physical slot), ``log2phy`` [layers, num_logical, num_replicas - num_logical + 1] (the slots of
    each logical expert in the order its replicas were made, padded with -1) and ``logcnt``
    [layers, num_logical] (replicas per logical expert). ValueError for impossible configurations.
    """
    w = _check_weight(weight)
    layers, num_logical = w.shape
    hierarchical = _check_config(
        num_logical, num_replicas, num_groups, num_nodes, num_ranks, one_replica_per_rank
    )
    if not hierarchical:
        num_groups = num_nodes = 1
    phy2log, replica_idx, logcnt = _hierarchical(
        w, num_replicas, num_groups, num_nodes, num_ranks, one_replica_per_rank
    )
    width = num_replicas - num_logical + 1
    log2phy = torch.full((layers, num_logical * width), -1, dtype=torch.int64)
    slots = torch.arange(num_replicas, dtype=torch.int64).expand(layers, -1)
    log2phy.scatter_(1, phy2log * width + replica_idx, slots)
    return phy2log, log2phy.view(layers, num_logical, width), logcnt


def placement_from_load(
    load: dict[int, list[float]],
    num_logical: int,
    num_ranks: int,
    num_redundant: int,
    num_groups: int,
    num_nodes: int,
) -> ExpertPlacement:
    """The EPLB placement of the layers in ``load`` (layer id -> load per logical expert), with
    ``num_logical + num_redundant`` slots per layer and at most one replica of an expert per rank."""
    if not load:
        raise ValueError("EPLB needs the load of at least one layer")
    if num_redundant < 0:
        raise ValueError(f"num_redundant must be >= 0, got {num_redundant}")
    layer_ids = sorted(load)
    rows = []
    for layer in layer_ids:
        values = load[layer]
        if len(values) != num_logical:
            raise ValueError(
                f"layer {layer}: load has {len(values)} values, expected {num_logical} (one per expert)"
            )
        rows.append([float(v) for v in values])
    weight = torch.tensor(rows, dtype=torch.float64)
    try:
        phy2log, _, _ = rebalance_experts(
            weight, num_logical + num_redundant, num_groups, num_nodes, num_ranks, one_replica_per_rank=True
        )
    except _LayerError as e:
        raise ValueError(f"layer {layer_ids[e.row]}: {e.message}") from None
    return ExpertPlacement(
        num_ranks, num_logical, dict(zip(layer_ids, map(tuple, phy2log.tolist()), strict=True))
    )


# Checks ---------------------------------------------------------------------------------------
class _LayerError(ValueError):
    def __init__(self, row: int, message: str) -> None:
        super().__init__(f"layer row {row}: {message}")
        self.row, self.message = row, message


def _check_weight(weight: torch.Tensor) -> torch.Tensor:
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] < 1:
        shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"weight must be a [layers, num_logical] tensor with num_logical >= 1, got {shape}")
    w = weight.detach().to("cpu", torch.float64)
    bad = (~torch.isfinite(w)) | (w < 0)
    if bad.any():
        row, col = (int(i) for i in bad.nonzero()[0])
        raise _LayerError(row, f"load of expert {col} is {w[row, col].item()}, not a finite value >= 0")
    return w


def _check_config(
    num_logical: int, num_replicas: int, num_groups: int, num_nodes: int, num_ranks: int, distinct: bool
) -> bool:
    """Whether the hierarchical policy applies; ValueError naming the numbers if nothing fits."""
    for name, value in (
        ("num_replicas", num_replicas),
        ("num_groups", num_groups),
        ("num_nodes", num_nodes),
        ("num_ranks", num_ranks),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if num_replicas < num_logical:
        raise ValueError(f"num_replicas = {num_replicas} is below the {num_logical} logical experts")
    if num_replicas % num_ranks:
        raise ValueError(f"num_replicas = {num_replicas} is not divisible by num_ranks = {num_ranks}")
    per_rank = num_replicas // num_ranks
    if num_groups % num_nodes:  # global policy: one group, one node
        if distinct and per_rank > num_logical:
            raise ValueError(
                f"{per_rank} slots per rank exceed the {num_logical} experts: a rank would host one twice"
            )
        return False
    if num_logical % num_groups:
        raise ValueError(f"num_logical = {num_logical} is not divisible by num_groups = {num_groups}")
    if num_ranks % num_nodes:
        raise ValueError(f"num_ranks = {num_ranks} is not divisible by num_nodes = {num_nodes}")
    if distinct and per_rank > num_logical // num_nodes:
        raise ValueError(
            f"{per_rank} slots per rank exceed the {num_logical // num_nodes} experts per node "
            f"({num_logical} experts on {num_nodes} nodes): a rank would host one twice"
        )
    return True


# The policy -----------------------------------------------------------------------------------
def _hierarchical(
    w: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_ranks: int, distinct: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    layers, num_logical = w.shape
    group_size = num_logical // num_groups
    per_node = num_logical // num_nodes  # logical experts per node
    slots_per_node = num_replicas // num_nodes
    ranks_per_node = num_ranks // num_nodes
    slots_per_rank = num_replicas // num_ranks

    # 1. Groups -> nodes. Renumber experts node-major ("node order"): node n holds node-order ids
    # [n * per_node, (n + 1) * per_node), each group's experts contiguous and in their own order.
    node, pos = _balanced_packing(w.view(layers, num_groups, group_size).sum(-1), num_nodes)
    group_start = (node * (num_groups // num_nodes) + pos) * group_size  # [layers, num_groups]
    to_node_order = (group_start.unsqueeze(-1) + torch.arange(group_size)).flatten(1)  # logical -> node order
    from_node_order = _inverse(to_node_order)

    # 2. Replicate inside each node (rows: (layer, node)).
    node_load = w.gather(1, from_node_order).view(layers * num_nodes, per_node)
    cap = ranks_per_node if distinct else None
    rep_expert, rep_idx, count = _replicate(node_load, slots_per_node, cap)

    # 3. The node's replicas -> its ranks.
    rep_load = (node_load / count).gather(1, rep_expert)
    rank, pos = _balanced_packing(rep_load, ranks_per_node)
    order = _inverse(rank * slots_per_rank + pos)  # node slot -> replica placed there
    slot_expert = rep_expert.gather(1, order)
    slot_idx = rep_idx.gather(1, order)
    if distinct:
        _separate_duplicates(slot_expert, slot_idx, node_load / count, slots_per_rank, num_nodes)

    offset = (torch.arange(num_nodes) * per_node).repeat(layers).unsqueeze(-1)  # node-local -> node order
    phy2log = from_node_order.gather(1, (slot_expert + offset).view(layers, num_replicas))
    logcnt = count.view(layers, num_logical).gather(1, to_node_order)
    return phy2log, slot_idx.view(layers, num_replicas), logcnt


def _balanced_packing(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Items [rows, n] -> (pack, position in pack), n / num_packs items per pack: heaviest item
    first (lower index on ties), each into the lightest pack with room (lower pack on ties)."""
    rows, n = weight.shape
    per_pack = n // num_packs
    pack = torch.empty((rows, n), dtype=torch.int64)
    pos = torch.empty((rows, n), dtype=torch.int64)
    if per_pack == 1:
        pack[:] = torch.arange(n)
        pos.zero_()
        return pack, pos
    order = torch.sort(weight, dim=1, descending=True, stable=True).indices.tolist()
    values = weight.tolist()
    for r in range(rows):
        heap = [(0.0, p, 0) for p in range(num_packs)]  # (load, pack, items), a valid heap
        row_pack, row_pos = [0] * n, [0] * n
        for item in order[r]:
            load, p, items = heapq.heappop(heap)
            row_pack[item], row_pos[item] = p, items
            if items + 1 < per_pack:
                heapq.heappush(heap, (load + values[r][item], p, items + 1))
        pack[r] = torch.tensor(row_pack)
        pos[r] = torch.tensor(row_pos)
    return pack, pos


def _replicate(
    weight: torch.Tensor, num_slots: int, cap: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Experts [rows, n] -> (expert of each replica [rows, num_slots], its replica index, replicas
    per expert [rows, n]). Replica j < n is expert j; each further one goes to the expert with the
    highest load per replica (lower index on ties) among those below ``cap`` replicas."""
    rows, n = weight.shape
    expert = torch.arange(num_slots, dtype=torch.int64).repeat(rows, 1)
    index = torch.zeros((rows, num_slots), dtype=torch.int64)
    count = torch.ones((rows, n), dtype=torch.int64)
    every = torch.arange(rows)
    for j in range(n, num_slots):
        per_replica = weight / count
        if cap is not None:
            per_replica = per_replica.masked_fill(count >= cap, -math.inf)
        e = per_replica.argmax(dim=1)
        expert[:, j] = e
        index[:, j] = count[every, e]
        count[every, e] += 1
    return expert, index, count


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    """Row-wise inverse of permutations [rows, n]."""
    inv = torch.empty_like(perm)
    inv.scatter_(1, perm, torch.arange(perm.shape[1], dtype=perm.dtype).expand_as(perm))
    return inv


def _separate_duplicates(
    expert: torch.Tensor, index: torch.Tensor, replica_load: torch.Tensor, slots_per_rank: int, num_nodes: int
) -> None:
    """In place, per row (node ``row % num_nodes`` of layer row ``row // num_nodes``): swap slots between ranks until no rank holds
    one expert twice. Each swap removes one duplicate and adds none; among the possible swaps the
    one leaving the lighter maximum of the two ranks' loads wins (lowest slots on ties)."""
    rows, slots = expert.shape
    for r in range(rows):
        row = expert[r].tolist()
        if all(
            len(set(row[k : k + slots_per_rank])) == slots_per_rank for k in range(0, slots, slots_per_rank)
        ):
            continue
        loads = replica_load[r].tolist()
        idx = index[r].tolist()
        while (swap := _best_swap(row, loads, slots_per_rank)) is not None:
            a, b = swap
            row[a], row[b] = row[b], row[a]
            idx[a], idx[b] = idx[b], idx[a]
        if any(
            len(set(row[k : k + slots_per_rank])) < slots_per_rank for k in range(0, slots, slots_per_rank)
        ):
            raise _LayerError(
                r // num_nodes, "cannot place the replicas without a rank hosting one expert twice"
            )
        expert[r] = torch.tensor(row)
        index[r] = torch.tensor(idx)


def _best_swap(row: list[int], loads: list[float], per_rank: int) -> tuple[int, int] | None:
    ranks = [row[k : k + per_rank] for k in range(0, len(row), per_rank)]
    rank_load = [sum(loads[e] for e in h) for h in ranks]
    best: tuple[float, int, int] | None = None
    for r, hosted in enumerate(ranks):
        dup = next((i for i, e in enumerate(hosted) if hosted.index(e) != i), None)
        if dup is None:
            continue
        e, a = hosted[dup], r * per_rank + dup
        for r2, other in enumerate(ranks):
            if r2 == r or e in other:
                continue
            for j, e2 in enumerate(other):
                if e2 in hosted:
                    continue
                delta = loads[e2] - loads[e]
                key = max(rank_load[r] + delta, rank_load[r2] - delta)
                if best is None or key < best[0]:
                    best = (key, a, r2 * per_rank + j)
        if best is not None:
            return best[1], best[2]
    return None
