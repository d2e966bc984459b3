"""One completion being generated: its tokens, its pages in the latent cache, its progress.

A request with ``n`` choices is ``n`` sequences sharing a request id. ``num_computed_tokens`` of
``token_ids`` (prompt then output) have their latent KV in ``pages``; the tokens after that are
computed by the next step(s) that schedule the sequence.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from dsinfer.base.sampling_params import SamplingParams
from dsinfer.base.stop_strings import StopStringMatcher

if TYPE_CHECKING:
    from dsinfer.engine.grammar_matcher import GrammarMatcher


class SeqStatus(Enum):
    WAITING = "waiting"
    RESERVED = "reserved"  # decode side of PD: pages held for the prompt's KV, which a prefill rank writes
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    choice: int  # index among the request's n choices
    prompt_len: int
    token_ids: list[int]  # prompt, then generated tokens
    params: SamplingParams
    seed: int  # the request's seed (drawn by the engine when the request gave none)
    max_tokens: int  # generated tokens allowed (max_tokens capped by max_model_len)
    eos_ids: frozenset[int]
    stop_matcher: StopStringMatcher | None = None  # only when the request has stop strings (offline)
    status: SeqStatus = SeqStatus.WAITING
    pages: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_prompt_tokens: int = 0  # served from the prefix cache at the last admission
    # MTP's proposals for the tokens after the last one, in order, verified by the next step
    drafts: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_text_len: int | None = None  # text is cut here when a stop string matched
    logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    grammar_matcher: GrammarMatcher | None = None  # with params.grammar, made at its first sampling
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    finish_time: float | None = None

    def __post_init__(self) -> None:
        if self.params.logprobs is not None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]  # the first prompt token has no prediction

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def key(self) -> str:
        """Unique among the engine's live sequences: what per-sequence model state is kept under."""
        return f"{self.request_id}/{self.choice}"

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    @property
    def uses_prefix_cache(self) -> bool:
        """Prompt logprobs need every prompt position computed, so those requests skip cache hits."""
        return self.params.prompt_logprobs is None

    def append(self, token: int, logprobs: dict[int, float] | None) -> None:
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        self.token_ids.append(token)
        if self.logprobs is not None and logprobs is not None:
            self.logprobs.append(logprobs)
        self.finish_reason = self._stop_reason(token)

    def _stop_reason(self, token: int) -> str | None:
        params = self.params
        if token in params.stop_token_ids or (token in self.eos_ids and not params.ignore_eos):
            return "stop"
        if self.stop_matcher is not None:
            self.stop_text_len = self.stop_matcher.feed(token)
            if self.stop_text_len is not None:
                return "stop"
        if self.num_output_tokens >= self.max_tokens:
            return "length"
        return None
