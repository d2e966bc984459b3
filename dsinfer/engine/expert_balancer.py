"""Online expert rebalancing: EPLB applied while a pool serves, without a stall or a changed token.

Every ``interval`` steps all ranks of the pool sum the expert load of the last window (tokens
routed to each logical expert per MoE layer since the previous check) with one all-reduce, so
every rank computes the same new placement from the same numbers (a pure function). When it
balances the window's load better by more than ``min_gain``, each rank stages the routed
experts of its new slots into shadow modules on a background thread, from the weights the model
was loaded from, while serving goes on. At every later step boundary the ranks agree (all-reduce
of a ready flag) whether every rank has staged; the step at which they all have, every rank
swaps its expert modules and routing tables before running its forward. Expert weights are the
same, only where they live changes, so no token changes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from dsinfer.model.deepseek_v3 import DeepseekV3ForCausalLM
from dsinfer.model.loader import ExpertSource
from dsinfer.model.moe import ExpertParallel, Experts, MoE
from dsinfer.parallel.eplb import placement_from_load
from dsinfer.parallel.placement import ExpertPlacement

log = logging.getLogger("dsinfer.eplb")

STAGING_NICE = 19  # Linux applies a thread's nice value to that thread alone
PlacementPolicy = Callable[[dict[int, list[float]], ExpertPlacement], ExpertPlacement]


def eplb_policy(num_groups: int) -> PlacementPolicy:
    """DeepSeek's EPLB (global policy: one pool-wide packing) with ``current``'s slot counts."""

    def policy(load: dict[int, list[float]], current: ExpertPlacement) -> ExpertPlacement:
        redundant = current.num_physical - current.num_logical
        return placement_from_load(load, current.num_logical, current.num_ranks, redundant, num_groups, 1)

    return policy


@dataclass
class Rebalance:
    step: int
    balance_before: float  # max/mean per-rank load of the window under the old placement
    balance_after: float  # the same load under the new placement
    stage_seconds: float = 0.0
    swap_step: int | None = None
    received_before: list[int] | None = None  # pairs this rank computed per MoE layer until the swap


class OnlineExpertBalancer:
    def __init__(
        self,
        model: DeepseekV3ForCausalLM,
        source: ExpertSource,
        *,
        interval: int,
        min_gain: float = 0.05,
        policy: PlacementPolicy | None = None,
    ) -> None:
        if model.ep is None:
            raise ValueError("online expert rebalancing needs an expert-parallel pool")
        self.model, self.source = model, source
        self.interval, self.min_gain = interval, min_gain
        self.policy = policy or eplb_policy(model.config.n_group)
        self.ep: ExpertParallel = model.ep
        self.steps = 0
        self._moes = {name: m for name, m in model.named_modules() if isinstance(m, MoE)}
        self._layer_of = {name: m.layer_id for name, m in self._moes.items()}
        self._last = self._cumulative()
        self._pending: tuple[ExpertPlacement, Future[dict[str, Experts]], float] | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="eplb-stage")
        self.history: list[Rebalance] = []

    def before_step(self) -> None:
        """Call at every step boundary, on every rank of the pool (it runs collectives)."""
        self.steps += 1
        if self._pending is not None:
            placement, staged, started = self._pending
            ready = torch.tensor([int(staged.done())], dtype=torch.int32)
            if self.ep.group.all_reduce(ready, "min").item():
                self._swap(placement, staged.result(), time.monotonic() - started)
            return
        if self.steps % self.interval == 0:
            self._check()

    def _cumulative(self) -> torch.Tensor:
        return torch.stack([m.expert_load.to(torch.float64) for m in self._moes.values()])

    def _check(self) -> None:
        total = self._cumulative()
        window = self.ep.group.all_reduce(total - self._last, "sum")
        self._last = total
        load = {self._layer_of[name]: row.tolist() for name, row in zip(self._moes, window, strict=True)}
        current = self.ep.placement
        candidate = self.policy(load, current)
        before, after = current.stats(load)["balance"], candidate.stats(load)["balance"]
        if candidate.layers == current.layers or before < after * (1 + self.min_gain):
            return
        self.history.append(Rebalance(self.steps, before, after))
        log.info(
            "step %d: expert placement %.3f -> %.3f max/mean per-rank load; staging new experts",
            self.steps,
            before,
            after,
        )
        staged = self._executor.submit(self._stage, candidate)
        self._pending = (candidate, staged, time.monotonic())

    def _stage(self, placement: ExpertPlacement) -> dict[str, Experts]:
        # the lowest CPU priority for this thread: serving steps must not wait for staging
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), STAGING_NICE)
        rank = self.ep.rank
        staged = {}
        for name, moe in self._moes.items():
            experts = placement.local_experts(moe.layer_id, rank)
            if experts != moe.experts.expert_ids:
                staged[name] = self.source.build(f"{name}.experts", experts)
        return staged

    def _swap(self, placement: ExpertPlacement, staged: dict[str, Experts], seconds: float) -> None:
        event = self.history[-1]
        event.received_before = [int(m.experts.slot_load.sum()) for m in self._moes.values()]
        ep = ExpertParallel(placement, self.ep.group)
        for name, moe in self._moes.items():
            moe.experts.slot_load.zero_()
            if name in staged:
                moe.experts = staged[name]
            moe.set_placement(ep)
        self.model.ep = self.ep = ep
        self._pending = None
        event.stage_seconds, event.swap_step = seconds, self.steps
        log.info("step %d: swapped to the new expert placement (staged in %.2f s)", self.steps, seconds)

    def close(self) -> None:
        self._executor.shutdown(wait=True)
