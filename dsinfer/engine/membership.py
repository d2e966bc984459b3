"""A change of an expert-parallel pool's membership (elastic EP), as the engine serves it."""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist

from dsinfer.engine.expert_balancer import OnlineExpertBalancer
from dsinfer.model.deepseek_v3 import DeepseekV3ForCausalLM
from dsinfer.parallel.ep import EPGroup
from dsinfer.parallel.placement import ExpertPlacement

SetAgreement = Callable[[EPGroup | None, dist.ProcessGroup | None], None]


class PoolMembership:
    def __init__(
        self,
        model: DeepseekV3ForCausalLM,
        balancer: OnlineExpertBalancer | None,
        set_agreement: SetAgreement,
    ) -> None:
        self._model, self._balancer, self._set_agreement = model, balancer, set_agreement

    @property
    def placement(self) -> ExpertPlacement | None:
        """The placement the pool serves with now (None without expert parallelism)."""
        return self._model.ep.placement if self._model.ep is not None else None

    def begin(self, placement: ExpertPlacement, rank: int) -> None:
        """Stage this rank's experts for ``placement`` (its index ``rank`` there) at the coming
        step boundaries, a bounded share of each (its ``regroup_staging`` vote says when done)."""
        assert self._balancer is not None, "a regroup needs an expert-parallel pool"
        self._balancer.begin_regroup(placement, rank)

    def regroup(
        self,
        ep_group: EPGroup,
        agreement_group: dist.ProcessGroup | None,
        placement: ExpertPlacement,
        rank: int,
    ) -> None:
        """Serve ``placement`` over a new pool group from the next step on: this rank's experts
        as staged (what is left of them staged now), its weights and KV as they are."""
        assert self._balancer is not None, "a regroup needs an expert-parallel pool"
        self._balancer.regroup(ep_group, placement, rank)
        self._set_agreement(ep_group, agreement_group)
