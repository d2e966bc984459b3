"""New requests become validated sequences: the checks every way in (offline, colocated, PD
prefill and decode, a migrated choice's continuation) shares, each error naming the problem."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from dsinfer.base.sampling_params import SamplingParams
from dsinfer.base.stop_strings import StopStringMatcher
from dsinfer.base.tokenizer import Tokenizer
from dsinfer.engine.sequence import Sequence


@dataclass
class SequenceFactory:
    vocab_size: int
    max_model_len: int
    eos_ids: frozenset[int]
    tokenizer: Tokenizer
    check_fits: Callable[
        [int, int], None
    ]  # (prompt tokens, max_tokens): ValueError when the KV cannot hold it
    check_grammar: Callable[[str | None], None]  # compiles (caches) a grammar: ValueError naming the problem
    seeds: random.Random  # draws the seed of a request that gave none

    def __call__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        first_choice: int,
        prefill_only: bool,
        output_token_ids: list[int],
    ) -> list[Sequence]:
        """The request's ``params.n`` sequences, choices numbered from ``first_choice``;
        ``prefill_only``: each ends after its next token; ``output_token_ids``: a continuation's
        tokens so far (prefilled after the prompt, counted as output)."""
        prompt_len, vocab = len(prompt_token_ids), self.vocab_size
        if prompt_len == 0:
            raise ValueError("prompt is empty")
        if prompt_len >= self.max_model_len:
            raise ValueError(f"prompt has {prompt_len} tokens; max_model_len is {self.max_model_len}")
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        max_tokens = min(params.max_tokens or self.max_model_len, self.max_model_len - prompt_len)
        if output_token_ids:
            if params.n != 1:
                raise ValueError(f"a continuation has one choice, got n={params.n}")
            if any(not 0 <= t < vocab for t in output_token_ids):
                raise ValueError(f"output token ids must be in [0, {vocab})")
            if len(output_token_ids) >= max_tokens:
                raise ValueError(
                    f"a continuation of {len(output_token_ids)} output tokens has none left of its {max_tokens}"
                )
        self.check_fits(prompt_len, max_tokens)
        self.check_grammar(params.grammar)
        seed = params.seed if params.seed is not None else self.seeds.getrandbits(63)
        stops = list(params.stop or [])
        return [
            Sequence(
                request_id=request_id,
                choice=first_choice + i,
                prompt_len=prompt_len,
                token_ids=[*prompt_token_ids, *output_token_ids],
                params=params,
                seed=seed,
                max_tokens=len(output_token_ids) + 1 if prefill_only else max_tokens,
                eos_ids=self.eos_ids,
                stop_matcher=StopStringMatcher(self.tokenizer, stops, params.skip_special_tokens)
                if stops and not prefill_only
                else None,
            )
            for i in range(params.n)
        ]
