"""The records the engine's façade hands to the workers around one step (dsinfer/engine/engine.py).

Workers never see the scheduler's sequences: a step's results are :class:`SeqUpdate`s, whose
wire form is :meth:`SeqUpdate.delta`; a PD prefill's per-layer writes are planned from
:class:`ScheduledWork`; a PD decode request waiting for its KV is a :class:`RemotePrefill`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from dsinfer.base.protocol import TokenDelta
from dsinfer.engine.agreement import StepVotes
from dsinfer.engine.scheduler import ScheduledBatch
from dsinfer.engine.sequence import Sequence

__all__ = ["KVReservation", "LayerHookFor", "RemotePrefill", "ScheduledWork", "SeqUpdate", "StepPlan"]


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


class SeqUpdate:
    """What one step added to one sequence (tokens, or its end)."""

    def __init__(self, seq: Sequence, new_token_ids: list[int], new_logprobs: list[dict[int, float]] | None):
        self._seq = seq
        self.new_token_ids, self.new_logprobs = new_token_ids, new_logprobs

    @property
    def request_id(self) -> str:
        return self._seq.request_id

    @property
    def finished(self) -> bool:
        return self._seq.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self._seq.finish_reason

    @property
    def mtp_draft(self) -> int | None:
        """The MTP layer's proposal after the last token (a PD prefill hands it to decode)."""
        return self._seq.draft

    def delta(self, num_cached_tokens: int | None = None) -> TokenDelta:
        """The wire form; the sequence's first delta carries the prompt's facts
        (``num_cached_tokens`` overrides the cached prompt tokens, e.g. the prefill rank's)."""
        seq = self._seq
        delta = TokenDelta(
            request_id=seq.request_id,
            token_ids=self.new_token_ids,
            logprobs=self.new_logprobs,
            finish_reason=seq.finish_reason,
        )
        if seq.num_output_tokens == len(self.new_token_ids):
            delta.num_prompt_tokens = seq.prompt_len
            delta.num_cached_tokens = (
                seq.num_cached_prompt_tokens if num_cached_tokens is None else num_cached_tokens
            )
            if seq.prompt_logprobs is not None:
                delta.prompt_logprobs = seq.prompt_logprobs[: seq.prompt_len]
        return delta


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
