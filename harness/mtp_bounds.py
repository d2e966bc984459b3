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

A step at a large batch is set by its arithmetic instead, where a verification of N + 1 tokens costs
N + 1 plain steps and drafting can only lose. :class:`Roofline` times each part of a step (dense
weights, routed experts, attention over the cached context) as the longer of reading its bytes and
doing its FLOPs at a machine's measured bandwidth and GEMM rate, and sums the parts: between the
two regimes, the part that is still bound by reading weights is what MTP wins back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsinfer.ops.gemm import linear, pack_linear_weight
from dsinfer.sim.model_dims import ModelShape
from harness.kernels import Timer

GEMM_ROWS = 128  # the rows of the measured GEMM: a verification's at batch 64
READ_BYTES = 256 * 2**20  # the measured read: well past any cache


def distinct_experts(experts: int, topk: int, tokens: int) -> float:
    """Expected experts one MoE layer reads for ``tokens`` tokens routed uniformly at random."""
    return experts * (1.0 - (1.0 - topk / experts) ** tokens)


def _routed_params(s: ModelShape, tokens: int) -> float:
    """One MoE layer's routed experts that ``tokens`` tokens read."""
    return distinct_experts(s.experts, s.topk, tokens) * s.expert_params


def _moe_layer_dense_params(s: ModelShape) -> float:
    """One MoE layer's weights read whatever its tokens: attention, router, shared experts."""
    return s.attention_params + s.experts * s.hidden + s.shared_experts * s.expert_params


def _step_dense_params(s: ModelShape) -> float:
    """A target step's weights read whatever its tokens (every layer but its routed experts, and
    the LM head)."""
    dense = s.dense_layers * (s.attention_params + s.dense_ffn_params)
    return dense + s.moe_layers * _moe_layer_dense_params(s) + s.vocab * s.hidden


def _draft_dense_params(s: ModelShape) -> float:
    """A draft's: the MTP layer's input projection, its MoE layer but the routed experts, its head."""
    return 2 * s.hidden * s.hidden + _moe_layer_dense_params(s) + s.vocab * s.hidden


def step_params(s: ModelShape, tokens: int) -> float:
    """Parameters a target step over ``tokens`` tokens reads (decoder layers and the LM head)."""
    return _step_dense_params(s) + s.moe_layers * _routed_params(s, tokens)


def draft_params(s: ModelShape, sequences: int) -> float:
    """Parameters the MTP layer reads drafting for ``sequences`` sequences: its input projection,
    one MoE layer at each sequence's last position, its head."""
    return _draft_dense_params(s) + _routed_params(s, sequences)


def measure_rates(device: torch.device, dtype: torch.dtype, hidden: int) -> tuple[float, float]:
    """(bytes a second read from memory, FLOP/s of a GEMM) on ``device``: a sum over 256 MB, and
    ``GEMM_ROWS`` rows through a ``4 * hidden x hidden`` weight of ``dtype`` as the engine runs it
    (packed where it packs); medians of up to 21 calls (harness.kernels.Timer)."""
    timer = Timer(warmup=3, iters=21, max_s=0.5, device=str(device))
    data = torch.ones(READ_BYTES // 4, dtype=torch.float32, device=device)
    bandwidth = READ_BYTES / (timer(data.sum)["median_us"] * 1e-6)
    weight = torch.randn(4 * hidden, hidden, device=device).to(dtype)
    packed = pack_linear_weight(weight)
    x = torch.randn(GEMM_ROWS, hidden, device=device).to(dtype)
    gemm_us = timer(lambda: linear(x, weight if packed is None else packed))["median_us"]
    return bandwidth, 2.0 * GEMM_ROWS * weight.numel() / (gemm_us * 1e-6)


@dataclass(frozen=True)
class Roofline:
    """A machine (``bandwidth`` bytes/s read, ``flops`` FLOP/s of a GEMM, both measured) and a
    model's storage (``weight_bytes`` per parameter, ``cache_bytes`` per latent value), with the
    mean ``context`` a step's sequences attend over."""

    bandwidth: float
    flops: float
    weight_bytes: int
    cache_bytes: int
    context: float

    def _part(self, nbytes: float, flops: float) -> float:
        return max(nbytes / self.bandwidth, flops / self.flops)

    def _attention(self, s: ModelShape, sequences: int, tokens: int, layers: int) -> float:
        keys = sequences * self.context
        return layers * self._part(
            keys * s.latent_dim * self.cache_bytes, tokens * self.context * s.mla_decode_flops_per_key
        )

    def _moe(self, s: ModelShape, tokens: int, layers: int) -> float:
        """Routed experts: the distinct experts' weights read, each token's top-k multiplied."""
        routed = _routed_params(s, tokens)
        return layers * self._part(routed * self.weight_bytes, 2.0 * tokens * s.topk * s.expert_params)

    def _dense(self, params: float, tokens: int) -> float:
        return self._part(params * self.weight_bytes, 2.0 * tokens * params)

    def step_seconds(self, s: ModelShape, sequences: int, tokens_per_seq: int) -> float:
        """A target step: ``tokens_per_seq`` query tokens for each of ``sequences`` sequences."""
        tokens = sequences * tokens_per_seq
        return (
            self._dense(_step_dense_params(s), tokens)
            + self._moe(s, tokens, s.moe_layers)
            + self._attention(s, sequences, tokens, s.layers)
        )

    def draft_seconds(self, s: ModelShape, sequences: int) -> float:
        """One draft: the MTP layer (its input projection, an MoE layer) and its head, at each
        sequence's last position."""
        return (
            self._dense(_draft_dense_params(s), sequences)
            + self._moe(s, sequences, 1)
            + self._attention(s, sequences, sequences, 1)
        )


@dataclass(frozen=True)
class MTPBound:
    batch: int
    verify_vs_plain: float  # weights a verification reads / a plain step's
    draft_share: float  # the drafts' weights / an MTP step's
    speedup: float  # tokens per step (1 + drafts x acceptance) over the MTP step's weights / a plain step's
    layer_floor: float  # drafts / (layers + drafts): the drafts' share when every layer costs the same
    num_drafts: int = 1
    # the same by a Roofline, and a plain step's time at it (None without one)
    roofline_verify_vs_plain: float | None = None
    roofline_draft_share: float | None = None
    roofline_speedup: float | None = None
    roofline_plain_ms: float | None = None

    @classmethod
    def of(
        cls,
        s: ModelShape,
        batch: int,
        acceptance: float,
        num_drafts: int = 1,
        roofline: Roofline | None = None,
        draft_roofline: Roofline | None = None,
    ) -> MTPBound:
        """``num_drafts`` a step (the MTP layer run once per draft), ``acceptance`` the share of
        drafts accepted: a verification reads ``num_drafts + 1`` tokens per sequence. With a
        ``roofline``, its timings of the same steps too. ``draft_roofline``: the MTP layer's own
        where it runs in another dtype (``--speculative-draft-dtype``: its weights' bytes and GEMM
        rate; the cache's stay the target's); the weights model then counts its weights' bytes."""
        plain, verify = step_params(s, batch), step_params(s, (num_drafts + 1) * batch)
        draft = num_drafts * draft_params(s, batch)
        if roofline is not None and draft_roofline is not None:
            draft *= draft_roofline.weight_bytes / roofline.weight_bytes
        timed: dict[str, float] = {}
        if roofline is not None:
            plain_s = roofline.step_seconds(s, batch, 1)
            verify_s = roofline.step_seconds(s, batch, num_drafts + 1)
            draft_s = num_drafts * (draft_roofline or roofline).draft_seconds(s, batch)
            timed = {
                "roofline_verify_vs_plain": verify_s / plain_s,
                "roofline_draft_share": draft_s / (verify_s + draft_s),
                "roofline_speedup": (1.0 + num_drafts * acceptance) * plain_s / (verify_s + draft_s),
                "roofline_plain_ms": plain_s * 1e3,
            }
        return cls(
            batch=batch,
            verify_vs_plain=verify / plain,
            draft_share=draft / (verify + draft),
            speedup=(1.0 + num_drafts * acceptance) * plain / (verify + draft),
            layer_floor=num_drafts / (s.layers + num_drafts),
            num_drafts=num_drafts,
            **timed,
        )

    @classmethod
    def drafts_for(cls, s: ModelShape, batch: int, target: float, most: int = 64) -> int | None:
        """The fewest drafts a step whose bound (every draft accepted) reaches ``target``x, if any
        up to ``most``."""
        return next((n for n in range(1, most + 1) if cls.of(s, batch, 1.0, n).speedup >= target), None)
