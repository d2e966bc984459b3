"""Requests whose prompt KV another rank writes: what a KV connector's decode side drives.

``new`` validates a one-choice request; ``reserve`` holds pages for every token known so far (a
prefix-cache hit first) while seats and pages allow; once the connector knows the KV has landed,
``join`` runs the request from the token the prefill rank sampled (after computing what KV did
not arrive: a V4 prompt's last partial page); ``cancel`` ends a reserved
request and hands its pages back still referenced, for the connector to release once no write of
the other rank can land in them (``KVPages.release``).
"""

from __future__ import annotations

from dsinfer.base.sampling_params import SamplingParams
from dsinfer.engine.requests import RequestTable
from dsinfer.engine.scheduler import Scheduler
from dsinfer.engine.sequence_factory import SequenceFactory
from dsinfer.engine.step import KVReservation, RemotePrefill, SeqUpdate


class RemotePrefills:
    def __init__(
        self,
        sequences: SequenceFactory,
        scheduler: Scheduler,
        requests: RequestTable,
        page_size: int,
        speculative: bool,
    ) -> None:
        self._sequences, self._scheduler, self._requests = sequences, scheduler, requests
        self._page_size, self._speculative = page_size, speculative

    def new(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        first_choice: int = 0,
        output_token_ids: list[int] | None = None,
    ) -> RemotePrefill:
        """A validated one-choice request (``output_token_ids``: a continuation, as
        ``LLMEngine.add_request`` takes it); raises ValueError naming the problem."""
        if params.n != 1:
            raise ValueError(f"n must be 1 for a remotely prefilled request, got {params.n}")
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        [seq] = self._sequences(
            request_id, prompt_token_ids, params, first_choice, False, output_token_ids or []
        )
        return RemotePrefill(seq)

    def reserve(self, request: RemotePrefill) -> KVReservation | None:
        """Pages for every known token, a prefix-cache hit first, or None while seats or pages
        are short. They stay reserved until joined or cancelled."""
        seq = request._seq
        cached = self._scheduler.reserve(seq)
        if cached is None:
            return None
        return KVReservation(cached, seq.pages[cached // self._page_size :])

    def join(
        self,
        request: RemotePrefill,
        first_token: int,
        logprobs: dict[int, float] | None,
        prompt_logprobs: list[dict[int, float] | None] | None,
        draft: int | None,
        computed: int | None = None,
    ) -> SeqUpdate:
        """The KV has arrived: the request runs from the prefill rank's token (the first, or a
        continuation's next). ``computed``: the tokens whose KV is here when not all of them
        (DeepSeek-V4: whole pages; this rank computes the rest first)."""
        seq = request._seq
        if seq.prompt_logprobs is not None and prompt_logprobs is not None:
            seq.prompt_logprobs = list(prompt_logprobs)
        self._requests.add(seq.request_id, [seq], None)
        if self._scheduler.join(seq, first_token, logprobs, computed):
            self._requests.collect([seq])
        elif self._speculative and computed is None:
            seq.drafts = [] if draft is None else [draft]
        return SeqUpdate.of(seq, [first_token], None if seq.logprobs is None else seq.logprobs[-1:])

    def pages(self, request: RemotePrefill) -> list[int]:
        """The reserved request's pages, its cached prefix's first."""
        return list(request._seq.pages)

    def cancel(self, request: RemotePrefill) -> list[int]:
        """End a reserved request; its pages come back still referenced."""
        return self._scheduler.cancel_reserved(request._seq)
