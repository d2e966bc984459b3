"""What bounds MTP's speed-up: the weights a plain step, a verification and a draft read.

A decode step whose time is set by reading weights (a large model at a small batch) costs in
proportion to the parameters it touches. Dense weights (attention, dense and shared FFNs, router,
heads) are read once whatever the tokens; routed experts are read once per distinct expert the
step's tokens pick. Under uniform routing, T tokens each picking k of N experts touch
``N * (1 - (1 - k/N) ** T)`` distinct experts, so a verification (two tokens per sequence) reads
more experts than a plain step at a small batch: the cost MTP cannot hide there. A step whose time
is set by per-operation overhead (a tiny model) costs in proportion to the layers it runs instead:
the MTP layer is one more layer, a floor of 1 / (layers + 1) under its share of an MTP step.

With N drafts a step the MTP layer runs N times and the verification reads N + 1 tokens per
sequence: at a small batch each further draft adds a draft's weights and the experts its token
picks, so the bound climbs slowly with N (and the drafts' share with it).
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
    draft_share: float  # the drafts' weights / an MTP step's
    speedup: float  # tokens per step (1 + drafts x acceptance) over the MTP step's weights / a plain step's
    layer_floor: float  # drafts / (layers + drafts): the drafts' share when every layer costs the same
    num_drafts: int = 1

    @classmethod
    def of(cls, s: ModelShape, batch: int, acceptance: float, num_drafts: int = 1) -> MTPBound:
        """``num_drafts`` a step (the MTP layer run once per draft), ``acceptance`` the share of
        drafts accepted: a verification reads ``num_drafts + 1`` tokens per sequence."""
        plain, verify = step_params(s, batch), step_params(s, (num_drafts + 1) * batch)
        draft = num_drafts * draft_params(s, batch)
        return cls(
            batch=batch,
            verify_vs_plain=verify / plain,
            draft_share=draft / (verify + draft),
            speedup=(1.0 + num_drafts * acceptance) * plain / (verify + draft),
            layer_floor=num_drafts / (s.layers + num_drafts),
            num_drafts=num_drafts,
        )

    @classmethod
    def drafts_for(cls, s: ModelShape, batch: int, target: float, most: int = 64) -> int | None:
        """The fewest drafts a step whose bound (every draft accepted) reaches ``target``x, if any
        up to ``most``."""
        return next((n for n in range(1, most + 1) if cls.of(s, batch, 1.0, n).speedup >= target), None)
