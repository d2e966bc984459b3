"""User-facing sampling parameters of one request (vLLM's field names and defaults).

Shared by the offline ``LLM`` API, the gateway (which maps OpenAI requests onto it) and the IPC
messages (a frozen dataclass, so msgspec encodes it as it is). Every field is checked at
construction; a bad value raises :class:`ValueError` whose message starts with the field's name,
which the gateway turns into an OpenAI 400 error. To change a field use
``dataclasses.replace(params, ...)``, which validates again.

Normalisations: ``top_k = -1`` (vLLM's "off") becomes ``0``; ``stop`` (a string, a list or None)
becomes a list of strings; ``stop_token_ids`` becomes a list (empty when None).

``seed = None`` means "unseeded": the engine draws a random seed for the request at admission
(the sampler itself is always counter-based, keyed by (seed, choice, position, draw)).
``max_tokens = None`` means "until the context length", as in the OpenAI API.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["GREEDY_TEMPERATURE", "SamplingParams"]

GREEDY_TEMPERATURE = 1e-5  # temperatures below this are greedy (dividing by them would overflow)
PENALTY_LIMIT = 2.0  # presence/frequency penalties live in [-2, 2] (OpenAI's range)
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for logit_bias values
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample the completion(s) of one request."""

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1 at construction) = off
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None  # always a list after construction
    stop_token_ids: list[int] | None = None  # always a list after construction
    ignore_eos: bool = False
    max_tokens: int | None = 16
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    min_tokens: int = 0  # eos and stop_token_ids are masked until this many tokens were generated
    grammar: str | None = None  # an llguidance grammar the output must match (dsinfer/base/grammar.py)

    def __post_init__(self) -> None:
        self._check_numbers()
        self._check_counts()
        self._normalise_stops()
        self._check_logit_bias()

    def _check_numbers(self) -> None:
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            value = getattr(self, name)
            if not _is_number(value) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -PENALTY_LIMIT <= value <= PENALTY_LIMIT:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")

    def _check_counts(self) -> None:
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= -1 (-1 or 0 = off), got {self.top_k!r}")
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1 (or None), got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise ValueError(
                f"grammar must be a string (an llguidance grammar), got {type(self.grammar).__name__}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 0):
                raise ValueError(f"{name} must be an integer >= 0 (or None), got {value!r}")
        if self.seed is not None and (not _is_int(self.seed) or not _INT64_MIN <= self.seed <= _INT64_MAX):
            raise ValueError(f"seed must be a 64-bit signed integer (or None), got {self.seed!r}")

    def _normalise_stops(self) -> None:
        stop = self.stop
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        else:
            stop = list(stop)
        if not all(isinstance(s, str) for s in stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if any(s == "" for s in stop):
            raise ValueError("stop must not contain an empty string")
        object.__setattr__(self, "stop", stop)
        ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        if not all(_is_int(t) and t >= 0 for t in ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", ids)

    def _check_logit_bias(self) -> None:
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, dict):
            raise ValueError(f"logit_bias must be a mapping of token id to bias, got {bias!r}")
        for token, value in bias.items():
            if not _is_int(token) or token < 0:
                raise ValueError(f"logit_bias keys must be non-negative token ids, got {token!r}")
            if not _is_number(value) or not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:
                raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {value!r}")

    @property
    def is_greedy(self) -> bool:
        """Temperature ~0: the sampler takes the argmax (after penalties) and ignores the seed."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def uses_penalties(self) -> bool:
        """Whether any of presence / frequency / repetition penalty is not neutral."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
