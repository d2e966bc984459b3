"""The records the engine's façade (dsinfer/engine/facade.py) hands to its callers around a step.

Callers never see the scheduler's sequences: a step's results are :class:`SeqUpdate`s (the
workers map them to wire messages); a KV connector's prefill side plans its per-layer writes from
:class:`ScheduledWork`; its decode side holds a :class:`RemotePrefill` while the KV arrives; the
engine's load is an :class:`EngineLoad` (the workers add theirs and map it to a LoadReport).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from dsinfer.engine.agreement import StepVotes
from dsinfer.engine.scheduler import ScheduledBatch
from dsinfer.engine.sequence import Sequence

__all__ = [
    "EngineLoad",
    "KVReservation",
    "LayerHook",
    "LayerHookFor",
    "RemotePrefill",
    "ScheduledWork",
    "SeqUpdate",
    "StepPlan",
]


@dataclass(frozen=True)
class ScheduledWork:
    """What the coming forward computes for one sequence, as a PD prefill plans its KV writes."""

    request_id: str
    context_len: int  # tokens whose KV the request's prefill computes (prompt; a continuation's output too)
    end: int  # tokens whose KV is in the cache after the forward
    pages: list[int]  # the sequence's pages, in token order


LayerHook = Callable[[int], None]  # called with each cache layer's index once its KV is written
LayerHookFor = Callable[[list[ScheduledWork]], LayerHook | None]


@dataclass
class StepPlan:
    """One rank's side of a step before the pool agrees: its batch and its votes."""

    batch: ScheduledBatch
    votes: StepVotes

    def work(self) -> list[ScheduledWork]:
        return [
            ScheduledWork(s.seq.request_id, s.seq.num_tokens, s.end, s.seq.pages) for s in self.batch.seqs
        ]


@dataclass(frozen=True)
class SeqUpdate:
    """What one step added to one sequence (tokens, or its end), taken when the step ends. A
    sequence's first update also carries the prompt's facts for the client."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None
    finished: bool
    finish_reason: str | None
    mtp_draft: int | None  # the MTP layer's proposal after the last token (a PD prefill hands it on)
    is_first: bool  # these are the sequence's first output tokens
    prompt_len: int
    num_cached_prompt_tokens: int
    prompt_logprobs: list[dict[int, float] | None] | None  # on the first update only

    @classmethod
    def of(
        cls, seq: Sequence, new_token_ids: list[int], new_logprobs: list[dict[int, float]] | None
    ) -> SeqUpdate:
        first = seq.num_output_tokens == len(new_token_ids)
        prompt = seq.prompt_logprobs
        return cls(
            seq.request_id,
            new_token_ids,
            new_logprobs,
            seq.is_finished,
            seq.finish_reason,
            seq.drafts[0] if seq.drafts else None,
            first,
            seq.prompt_len,
            seq.num_cached_prompt_tokens,
            prompt[: seq.prompt_len] if first and prompt is not None else None,
        )


class RemotePrefill:
    """A one-choice request on a PD decode rank whose prompt KV a prefill rank writes."""

    def __init__(self, seq: Sequence) -> None:
        self._seq = seq

    @property
    def request_id(self) -> str:
        return self._seq.request_id


@dataclass(frozen=True)
class KVReservation:
    """Pages held for a remote prefill: the first ``num_cached_tokens`` known tokens came from
    this rank's prefix cache (whole pages); ``pages`` receive the rest of them, in order."""

    num_cached_tokens: int
    pages: list[int]


@dataclass
class EngineLoad:
    """The engine's part of a rank's load (queues, KV, prefix-cache counters since start)."""

    num_running: int
    num_waiting: int
    kv_pages_used: int
    kv_pages_total: int
    pending_prefill_tokens: int  # prompt tokens admitted or queued but not yet computed
    pending_attention_load: int  # sum over queued prefills of new tokens x total context
    prompt_tokens: int
    memory_hit_tokens: int
    disk_hit_tokens: int
    host_hit_tokens: int = 0
    kv_tiers: dict[str, dict[str, float]] = field(default_factory=dict)  # KVCacheManager.tier_report()
    kv_disk_tier_id: str = ""  # ranks reporting one id share the disk tier's directory
    mtp_drafts_proposed: int = 0  # MTP draft tokens verified since start
    mtp_drafts_accepted: int = 0  # of which the target model agreed with
    mtp_verifications: int = 0  # sequence-steps that verified drafts since start
    eplb_swaps: int = 0  # expert placements swapped in by online rebalancing since start
    expert_load: dict[int, list[int]] | None = None
