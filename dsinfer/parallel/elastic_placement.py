"""Expert placements of a pool whose membership changes (elastic EP): pure functions that every
rank of the pool computes alike from the same inputs.

- ``keep_ranks``: the placement over some of a placement's ranks (the survivors of a dead rank).
  Each kept rank keeps every expert it holds (no weight moves where none must); an expert that
  only the others held goes to the kept rank with the fewest slots. Every rank then gets as many
  slots as the fullest one, the extra ones copies of the least-replicated experts it lacks (a
  layer's slot count is the same on every rank and every layer).
- ``placement_for_members``: the placement a pool of the given members serves with when it
  forms: the pool's initial placement over the ranks present (all of them: the initial one).
  A restarted rank loads its experts for it before it rejoins, and the ranks already serving
  stage theirs for it meanwhile.
"""

from __future__ import annotations

from collections.abc import Sequence

from dsinfer.parallel.placement import ExpertPlacement

__all__ = ["keep_ranks", "placement_for_members"]


def keep_ranks(placement: ExpertPlacement, kept: Sequence[int]) -> ExpertPlacement:
    """The placement over ``kept`` (indices of ``placement``'s ranks; rank i of the result is
    ``kept[i]``), holding every logical expert."""
    if not kept or len(set(kept)) != len(kept) or not all(0 <= r < placement.num_ranks for r in kept):
        raise ValueError(
            f"kept ranks {list(kept)} are not distinct ranks of a {placement.num_ranks}-rank placement"
        )
    hosted = {layer: _kept_layer(placement, layer, kept) for layer in placement.layers}
    width = max(len(experts) for per_rank in hosted.values() for experts in per_rank)
    layers = {
        layer: tuple(e for experts in _padded(per_rank, width, placement.num_logical) for e in experts)
        for layer, per_rank in hosted.items()
    }
    return ExpertPlacement(len(kept), placement.num_logical, layers)


def placement_for_members(initial: ExpertPlacement, members: Sequence[int]) -> ExpertPlacement:
    """The placement of a pool formed by ``members`` (ranks of the pool that started with
    ``initial``, in the group's order)."""
    if list(members) == list(range(initial.num_ranks)):
        return initial
    return keep_ranks(initial, members)


def _kept_layer(placement: ExpertPlacement, layer: int, kept: Sequence[int]) -> list[list[int]]:
    hosted = [placement.local_experts(layer, r) for r in kept]
    held = {e for experts in hosted for e in experts}
    for expert in range(placement.num_logical):
        if expert not in held:
            fewest = min(range(len(hosted)), key=lambda i: (len(hosted[i]), i))
            hosted[fewest].append(expert)
    return hosted


def _padded(hosted: list[list[int]], width: int, num_logical: int) -> list[list[int]]:
    copies = [0] * num_logical
    for experts in hosted:
        for e in experts:
            copies[e] += 1
    out = []
    for experts in hosted:
        experts = list(experts)
        while len(experts) < width:
            mine = set(experts)
            extra = min((e for e in range(num_logical) if e not in mine), key=lambda e: (copies[e], e))
            experts.append(extra)
            copies[extra] += 1
        out.append(experts)
    return out
