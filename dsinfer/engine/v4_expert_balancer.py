"""Online EPLB for a DeepSeek-V4 pool: the contract of dsinfer/engine/expert_balancer.py (the
window's load all-reduced, the same placement computed on every rank, staging in pieces at step
boundaries under the budget, a swap at the boundary the step agreement picks), over V4's MoE
layers (``V4MoE``, hash-routed layers and the MTP layer's included: a hash table picks logical
experts as a router does) and experts staged from the checkpoint by ``V4ExpertSource``. V4's
experts group into none (``n_group`` 1).
"""

from __future__ import annotations

import torch

from dsinfer.engine.expert_balancer import OnlineExpertBalancer
from dsinfer.model.moe import ExpertParallel
from dsinfer.model.v4_experts import V4ExpertSource, V4ExpertStaging
from dsinfer.model.v4_moe import V4MoE
from dsinfer.model.v4_served import ServedV4
from dsinfer.parallel.placement import ExpertPlacement


class V4ExpertBalancer(OnlineExpertBalancer):
    model: ServedV4
    source: V4ExpertSource
    _moes: dict[str, V4MoE]

    def _expert_groups(self) -> int:
        return 1

    def _find_moes(self) -> dict[str, V4MoE]:
        return {name: m for name, m in self.model.named_modules() if isinstance(m, V4MoE)}

    def _received(self) -> list[int]:
        return []

    def _staging_for(self, placement: ExpertPlacement, rank: int) -> V4ExpertStaging:
        wanted = {}
        for name, moe in self._moes.items():
            experts = placement.local_experts(moe.layer_id, rank)
            if experts != moe.local_experts:
                wanted[name] = experts
        return self.source.stage(wanted, self._moes)

    def _install(
        self, ep: ExpertParallel, staged: dict[str, tuple[list[int], dict[str, torch.Tensor]]]
    ) -> None:
        for name, moe in self._moes.items():
            self._retired.extend(moe.install(ep, staged.get(name)))
        self.model.ep = self.model.model.ep = self.ep = ep

    def close(self) -> None:
        super().close()
        self.source.close()
