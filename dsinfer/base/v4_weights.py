"""DeepSeek-V4's weights on one rank, counted from its config without tensors: what the memory
plan (``dsinfer serve --dry-run``) and the simulator charge a rank, so they cannot disagree.

Parameters fall in three kinds, as the loader keeps them: the linear layers but the head (FP8 on a
GPU, 128x128 blocks with a 4-byte scale each), the routed experts (``ffn.w13``/``ffn.w2``: packed
MXFP4 where the MXFP4 GEMM runs, else in the model's dtype; a rank of an expert-parallel pool
holds its slots' share), and the rest in the model's dtype (embedding, head, norms, mHC, gates,
sinks, the compressors' positional biases). tests/test_v4_weights.py checks the counts against the
model built on the meta device.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsinfer.base.v4_config import CSA, V4Config

FP8_BLOCK_VALUES = 128 * 128
MXFP4_BYTES_PER_VALUE = 0.5 + 1 / 32  # an e2m1 nibble and its share of an e8m0 scale per 32


@dataclass(frozen=True)
class V4Weights:
    fp8: int  # bytes of FP8 weights and their block scales
    experts: int  # this rank's routed experts: packed MXFP4, or in the model's dtype
    other: int  # the rest (embedding, head, norms, mHC, gates, sinks) in the model's dtype
    mxfp4: bool = False  # the experts stay packed

    @property
    def total(self) -> int:
        return self.fp8 + self.experts + self.other


@dataclass(frozen=True)
class V4ParameterCounts:
    linear: tuple[int, ...]  # each linear layer's weight but the head's (its FP8 blocks are per matrix)
    experts: int  # every layer's routed experts
    other: int

    @classmethod
    def of(cls, config: V4Config, mtp_layers: int = 0) -> V4ParameterCounts:
        """``mtp_layers``: the release's MTP layers too (each a layer over its window, routed, with
        its two input projections, three norms and stream head)."""
        hidden, heads, head_dim = config.hidden_size, config.num_attention_heads, config.head_dim
        linear: list[int] = []
        other = 2 * config.vocab_size * hidden + hidden  # embedding, head, final norm
        hc, hc_width = config.hc_mult, config.hc_mult * hidden
        other += hc * hc_width + hc + 1  # the head's stream collapse
        mixing = (2 + hc) * hc
        inter = config.moe_intermediate_size
        experts = 0
        layers = config.num_hidden_layers + mtp_layers
        for layer, kind in enumerate(config.layer_kind(i) for i in range(layers)):
            if layer >= config.num_hidden_layers:  # an MTP layer's own parts
                linear += [hidden * hidden] * 2
                other += 3 * hidden + hc * hc_width + hc + 1
            linear += [
                hidden * config.q_lora_rank,
                config.q_lora_rank * heads * head_dim,
                hidden * head_dim,
                heads * head_dim * config.o_lora_rank,
                config.o_groups * config.o_lora_rank * hidden,
            ]
            other += heads + config.q_lora_rank + head_dim  # sink, q and kv norms
            rate = config.compress_rate(layer)
            if rate:
                width = head_dim * (2 if kind == CSA else 1)  # CSA's windows overlap
                linear += [hidden * width] * 2
                other += rate * width + head_dim
            if kind == CSA:  # the indexer and its own overlapping compressor
                width = 2 * config.index_head_dim
                linear += [hidden * width] * 2
                other += rate * width + config.index_head_dim
                linear += [config.q_lora_rank * config.index_n_heads * config.index_head_dim]
                linear += [hidden * config.index_n_heads]
            experts += config.n_routed_experts * 3 * hidden * inter
            linear += [hidden * inter * config.n_shared_experts] * 3
            other += config.n_routed_experts * hidden  # the gate
            other += 2 * hidden + 2 * (mixing * hc_width + mixing + 3)  # norms, attention and FFN mHC
        return cls(tuple(linear), experts, other)

    def on_rank(self, dtype_bytes: int, fp8: bool, mxfp4: bool = False, share: float = 1.0) -> V4Weights:
        """Weight bytes on one rank: ``fp8``, the linear layers FP8; ``mxfp4``, the experts packed;
        ``share``, the part of the experts the rank holds (its slots of an expert-parallel pool)."""
        experts = round(self.experts * (MXFP4_BYTES_PER_VALUE if mxfp4 else dtype_bytes) * share)
        if not fp8:
            return V4Weights(0, experts, (sum(self.linear) + self.other) * dtype_bytes, mxfp4)
        fp8_bytes = sum(n + 4 * -(-n // FP8_BLOCK_VALUES) for n in self.linear)
        return V4Weights(fp8_bytes, experts, self.other * dtype_bytes, mxfp4)
