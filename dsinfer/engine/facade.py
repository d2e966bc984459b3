"""The engine as its callers outside the engine package see it: one typed Protocol.

:class:`dsinfer.engine.engine.LLMEngine` implements it. The workers (and the KV connector) type
their engine as ``EngineFacade`` and import-linter keeps them off the scheduler, the sequences,
the cache and the model. What it holds:

- requests: ``add_request``, ``abort_request``, ``has_request``, ``has_unfinished_requests``;
- one step in lockstep with the pool (dsinfer/engine/agreement.py): ``plan_step``, ``agree``,
  ``run_step`` (with a per-layer hook: a KV connector's prefill side writes there);
- ``kv_pages``: the KV pool as pages (geometry, the tensors to register, page references);
- ``remote``: requests whose prompt KV another rank writes (a KV connector's decode side);
- ``membership``: a change of the pool's membership (elastic EP);
- ``load``, ``warmup``, ``close``, and what a rank registers with: ``max_model_len``,
  ``model_identity``.
"""

from __future__ import annotations

from typing import Protocol

from dsinfer.base.sampling_params import SamplingParams
from dsinfer.engine.agreement import StepVotes
from dsinfer.engine.kv_pages import KVPages
from dsinfer.engine.membership import PoolMembership
from dsinfer.engine.remote import RemotePrefills
from dsinfer.engine.step import EngineLoad, LayerHookFor, SeqUpdate, StepPlan

__all__ = ["EngineFacade"]


class EngineFacade(Protocol):
    kv_pages: KVPages
    remote: RemotePrefills
    membership: PoolMembership
    max_model_len: int
    model_identity: str

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        *,
        first_choice: int = 0,
        prefill_only: bool = False,
        output_token_ids: list[int] | None = None,
    ) -> None: ...

    def abort_request(self, request_id: str) -> None: ...

    def has_request(self, request_id: str) -> bool: ...

    def has_unfinished_requests(self) -> bool: ...

    def plan_step(self) -> StepPlan: ...

    def agree(self, votes: StepVotes) -> StepVotes: ...

    def run_step(
        self, plan: StepPlan, agreed: StepVotes, layer_hook_for: LayerHookFor | None = None
    ) -> list[SeqUpdate]: ...

    def load(self, with_expert_load: bool = False) -> EngineLoad: ...

    def warmup(self) -> None: ...

    def close(self) -> None: ...
