"""Results of the simulator's costly pure functions, kept by whoever runs many simulations.

Building a pool's expert model runs the placement algorithm and samples the router (about a
second at EP144), and calibrating a traffic profile samples a few hundred thousand requests; a
planner run or the report needs each of them hundreds of times with the same arguments. A
``SimCache`` is an explicit object for that: a ``Simulation``, the planner and the report take
one (or make their own), and nothing is kept at module level. Every entry is a pure function of
its key, so sharing a cache never changes a result, only how long it takes.
"""

from __future__ import annotations

from dsinfer.sim.cost import PoolModel
from dsinfer.sim.deployment import Assumptions, PoolSpec, expert_key, pool_model
from dsinfer.sim.experts import ExpertModel, expert_model
from dsinfer.sim.hardware import Hardware
from dsinfer.sim.model_dims import ModelShape
from dsinfer.sim.workload import Lengths, TrafficProfile, calibrate


class SimCache:
    def __init__(self) -> None:
        self._lengths: dict[TrafficProfile, Lengths] = {}
        self._experts: dict[tuple[str, int, int, int, str, float, int], ExpertModel] = {}
        self._pools: dict[
            tuple[PoolSpec, Hardware, tuple[str, int, int, int, str, float, int]], PoolModel
        ] = {}
        self.misses = 0  # entries computed (not found)

    def lengths(self, profile: TrafficProfile) -> Lengths:
        """``calibrate(profile)``."""
        found = self._lengths.get(profile)
        if found is None:
            self.misses += 1
            found = self._lengths[profile] = calibrate(profile)
        return found

    def expert_model(self, spec: PoolSpec, a: Assumptions) -> ExpertModel:
        key = expert_key(spec, a)
        found = self._experts.get(key)
        if found is None:
            self.misses += 1
            model, ranks, gpus_per_node, redundant, policy, skew, seed = key
            found = self._experts[key] = expert_model(
                ModelShape.preset(model), ranks, gpus_per_node, redundant, policy, skew, seed
            )
        return found

    def pool_model(self, spec: PoolSpec, a: Assumptions) -> PoolModel:
        """``pool_model(spec, a)``; pools that differ only in what the expert model does not
        depend on (step budgets, overlap, ...) share one expert model."""
        key = (spec, a.hardware, expert_key(spec, a))
        found = self._pools.get(key)
        if found is None:
            self.misses += 1
            found = self._pools[key] = pool_model(spec, a, self.expert_model(spec, a))
        return found
