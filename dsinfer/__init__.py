"""dsinfer: inference for DeepSeek-V3/R1-architecture models.

``from dsinfer import LLM, SamplingParams`` is the offline API; both are imported on first use so
that ``import dsinfer.base...`` stays light.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from dsinfer.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from dsinfer.base.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'dsinfer' has no attribute {name!r}")
