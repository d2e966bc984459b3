"""SamplingParams: vLLM defaults, validation naming the field, normalisations."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from dsinfer.base.sampling_params import SamplingParams


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (1.0, 1.0, 0, 0.0)
    assert p.seed is None and p.max_tokens == 16 and p.n == 1
    assert p.stop == [] and p.stop_token_ids == [] and p.ignore_eos is False
    assert p.logprobs is None and p.prompt_logprobs is None and p.skip_special_tokens is True
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert not p.is_greedy and not p.uses_penalties


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_p", -0.5),
        ("top_k", -2),
        ("top_k", 2.5),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("n", 0),
        ("logprobs", -1),
        ("prompt_logprobs", -1),
        ("presence_penalty", 2.01),
        ("presence_penalty", -2.5),
        ("frequency_penalty", 3.0),
        ("frequency_penalty", -2.01),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("seed", 2**64),
        ("stop", [""]),
        ("stop", ["ok", 3]),
        ("stop_token_ids", [-1]),
    ],
)
def test_bad_field_raises_naming_it(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_boundaries_accepted() -> None:
    SamplingParams(temperature=0.0, top_p=1.0, min_p=1.0, presence_penalty=-2.0, frequency_penalty=2.0)
    SamplingParams(top_p=1e-9, min_p=0.0, top_k=1, max_tokens=1, logprobs=0, prompt_logprobs=0)
    SamplingParams(repetition_penalty=1e-3, seed=-(2**63), max_tokens=None)


def test_normalisations() -> None:
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(top_k=40).top_k == 40
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]  # type: ignore[arg-type]
    assert SamplingParams(stop_token_ids=(5, 7)).stop_token_ids == [5, 7]  # type: ignore[arg-type]
    # replace() validates again and keeps the normalised forms
    p = dataclasses.replace(SamplingParams(stop="x", top_k=-1), temperature=0.5)
    assert p.stop == ["x"] and p.top_k == 0 and p.temperature == 0.5
    with pytest.raises(ValueError, match="temperature"):
        dataclasses.replace(p, temperature=-1.0)


def test_properties() -> None:
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=1e-6).is_greedy
    assert not SamplingParams(temperature=1e-5).is_greedy
    assert SamplingParams(presence_penalty=0.5).uses_penalties
    assert SamplingParams(frequency_penalty=-0.1).uses_penalties
    assert SamplingParams(repetition_penalty=1.2).uses_penalties


def test_frozen_and_equality() -> None:
    p = SamplingParams(seed=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 0.0  # type: ignore[misc]
    assert p == SamplingParams(seed=3) and p != SamplingParams(seed=4)
