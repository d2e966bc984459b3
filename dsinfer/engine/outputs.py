"""Results in the shape vLLM users know: a RequestOutput per prompt holding n CompletionOutputs."""

from __future__ import annotations

from dataclasses import dataclass

from dsinfer.base.tokenizer import Tokenizer
from dsinfer.engine.sequence import Sequence


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length" or "abort"
    logprobs: list[dict[int, float]] | None  # per generated token: id -> logprob (sampled one included)


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None
    finish_time: float
    num_cached_tokens: int  # prompt tokens served from the prefix cache

    # vLLM's names, which benchmark tools read
    @property
    def first_token_latency(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def first_token_ts(self) -> float | None:
        return self.first_token_time

    @property
    def last_token_ts(self) -> float:
        return self.finish_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, float] | None] | None
    outputs: list[CompletionOutput]
    metrics: RequestMetrics
    finished: bool = True


def build_output(
    request_id: str, prompt: str | None, seqs: list[Sequence], tokenizer: Tokenizer
) -> RequestOutput:
    completions = []
    for seq in seqs:
        if seq.stop_matcher is not None:
            detokenizer = seq.stop_matcher.detokenizer
            text = detokenizer.text + ("" if seq.stop_text_len is not None else detokenizer.flush())
            if seq.stop_text_len is not None:
                text = text[: seq.stop_text_len]
        else:
            text = tokenizer.decode(seq.output_token_ids, skip_special_tokens=seq.params.skip_special_tokens)
        completions.append(
            CompletionOutput(seq.choice, text, seq.output_token_ids, seq.finish_reason, seq.logprobs)
        )
    first = seqs[0]
    metrics = RequestMetrics(
        arrival_time=first.arrival_time,
        first_token_time=min((s.first_token_time for s in seqs if s.first_token_time), default=None),
        finish_time=max(s.finish_time or 0.0 for s in seqs),
        num_cached_tokens=first.num_cached_prompt_tokens,
    )
    prompt_ids = first.token_ids[: first.prompt_len]
    return RequestOutput(request_id, prompt, prompt_ids, first.prompt_logprobs, completions, metrics)
