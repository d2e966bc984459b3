"""What bounds MTP's speed-up: the weights a plain step, a verification and a draft read.

A decode step whose time is set by reading weights (a large model at a small batch) costs in
proportion to the parameters it touches. Dense weights (attention, dense and shared FFNs, router,
heads) are read once whatever the tokens; routed experts are read once per distinct expert the
step's tokens pick. Under uniform routing, T tokens each picking k of N experts touch
``N * (1 - (1 - k/N) ** T)`` distinct experts, so a verification (two tokens per sequence) reads
more experts than a plain step at a small batch: the cost MTP cannot hide there. A step whose time
is set by per-operation overhead (a tiny model) costs in proportion to the layers it runs instead:
the MTP layer is one more layer, a floor of 1 / (layers + 1) under its share of an MTP step.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsinfer.sim.model_dims import ModelShape


def distinct_experts(experts: int, topk: int, tokens: int) -> float:
    """Expected experts one MoE layer reads for ``tokens`` tokens routed uniformly at random."""
    return experts * (1.0 - (1.0 - topk / experts) ** tokens)


def _moe_layer(s: ModelShape, tokens: int) -> float:
    routed = distinct_experts(s.experts, s.topk, tokens)
    return s.attention_params + s.experts * s.hidden + (s.shared_experts + routed) * s.expert_params


def step_params(s: ModelShape, tokens: int) -> float:
    """Parameters a target step over ``tokens`` tokens reads (decoder layers and the LM head)."""
    dense = s.dense_layers * (s.attention_params + s.dense_ffn_params)
    return dense + s.moe_layers * _moe_layer(s, tokens) + s.vocab * s.hidden


def draft_params(s: ModelShape, sequences: int) -> float:
    """Parameters the MTP layer reads drafting for ``sequences`` sequences: its input projection,
    one MoE layer at each sequence's last position, its head."""
    return 2 * s.hidden * s.hidden + _moe_layer(s, sequences) + s.vocab * s.hidden


@dataclass(frozen=True)
class MTPBound:
    batch: int
    verify_vs_plain: float  # weights a verification reads / a plain step's
    draft_share: float  # the draft's weights / an MTP step's
    speedup: float  # tokens per step (1 + acceptance) over the MTP step's weights / a plain step's
    layer_floor: float  # 1 / (layers + 1): the draft's share when every layer costs the same

    @classmethod
    def of(cls, s: ModelShape, batch: int, acceptance: float) -> MTPBound:
        plain, verify = step_params(s, batch), step_params(s, 2 * batch)
        draft = draft_params(s, batch)
        return cls(
            batch=batch,
            verify_vs_plain=verify / plain,
            draft_share=draft / (verify + draft),
            speedup=(1.0 + acceptance) * plain / (verify + draft),
            layer_floor=1.0 / (s.layers + 1),
        )
