"""One rank's share of a model in a deployment, without tensors: weight bytes, KV bytes per token,
expert slots per rank.

The memory plan (``dsinfer serve --dry-run``, ``--gpu-memory``), the simulator, the rank (its EP
group's sizes) and the expert placement all count from here, so they cannot disagree. Weights are
counted the way the loader lays them out: FP8 projections (attention, dense MLPs, shared and
routed experts) stay FP8 with fp32 128x128 block scales where ``fp8`` (a device that runs FP8
GEMMs), everything else (embedding, lm_head, norms, router, MLA's dequantized kv_b_proj copy for
the absorbed path) in the model dtype. A rank of a pool of N holds ``expert_slots_per_rank``
routed expert slots per MoE layer and everything else whole. The KV cache is counted per cache
layer and token: ``cache_bytes_per_token`` (the MLA latent by default; a model with more
per-token caches, such as V3.2's indexer keys, passes its cache spec's bytes).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from dsinfer.base.config import FP8_BLOCK, PAGE_SIZE, ModelConfig

__all__ = ["RankShape", "WeightBytes", "expert_slots_per_rank"]


def expert_slots_per_rank(num_logical: int, num_redundant: int, num_ranks: int) -> int:
    """Routed expert slots each rank holds per MoE layer; ValueError when the slots cannot be
    spread evenly or a rank would hold one expert twice."""
    if num_ranks < 1 or num_logical < 1 or num_redundant < 0:
        raise ValueError(
            f"need num_ranks >= 1, num_logical >= 1, num_redundant >= 0; got {num_ranks}, "
            f"{num_logical}, {num_redundant}"
        )
    total = num_logical + num_redundant
    if total % num_ranks:
        raise ValueError(
            f"{num_logical} routed + {num_redundant} redundant experts = {total} slots cannot be spread "
            f"evenly over {num_ranks} ranks: the redundant experts must make the total a multiple of the "
            "pool size"
        )
    if total // num_ranks > num_logical:
        raise ValueError(
            f"{total // num_ranks} slots per rank exceed the {num_logical} routed experts (a rank would "
            f"host one expert twice): at most {num_logical * (num_ranks - 1)} redundant experts on "
            f"{num_ranks} ranks"
        )
    return total // num_ranks


@dataclass(frozen=True)
class WeightBytes:
    """Bytes per category, split by how they are stored: FP8 (with block scales) or the model dtype."""

    fp8: dict[str, int] = field(default_factory=dict)
    dense: dict[str, int] = field(default_factory=dict)

    @property
    def fp8_total(self) -> int:
        return sum(self.fp8.values())

    @property
    def dense_total(self) -> int:
        return sum(self.dense.values())

    @property
    def total(self) -> int:
        return self.fp8_total + self.dense_total


@dataclass(frozen=True)
class RankShape:
    """One rank of a pool of ``pool_size`` serving ``config``."""

    config: ModelConfig
    dtype_bytes: int  # the model dtype's (2 for bfloat16)
    fp8: bool  # FP8 checkpoint weights kept FP8
    pool_size: int = 1
    num_redundant_experts: int = 0
    mtp_layers: int = 0  # MTP layers loaded (--speculative-mtp)
    cache_bytes_per_token: int | None = None  # one cache layer's, every per-token cache; None: the latent

    def __post_init__(self) -> None:
        self.expert_slots  # noqa: B018 - ValueError for a pool its experts cannot be spread over

    @property
    def expert_slots(self) -> int:
        """Routed expert slots this rank holds per MoE layer."""
        return expert_slots_per_rank(self.config.n_routed_experts, self.num_redundant_experts, self.pool_size)

    # KV cache ------------------------------------------------------------------------------------
    @property
    def cache_layers(self) -> int:
        return self.config.num_hidden_layers + self.mtp_layers

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes one token takes in the KV cache, over every cache layer."""
        per_layer = self.cache_bytes_per_token
        if per_layer is None:
            per_layer = self.config.kv_cache_dim * self.dtype_bytes
        return self.cache_layers * per_layer

    def page_bytes(self, page_size: int = PAGE_SIZE) -> int:
        return page_size * self.kv_bytes_per_token

    def kv_pages(self, budget_bytes: int, page_size: int = PAGE_SIZE) -> int:
        """Pages that fit in ``budget_bytes`` (rounded down; 0 when not one fits)."""
        if budget_bytes < 0:
            raise ValueError(f"memory budget must be >= 0 bytes, got {budget_bytes}")
        return budget_bytes // self.page_bytes(page_size)

    # Weights -------------------------------------------------------------------------------------
    def weights(self) -> WeightBytes:
        """This rank's weights: its routed slots, everything else whole, the MTP layers loaded."""
        c, item, routed = self.config, self.dtype_bytes, self.expert_slots
        fp8: Counter[str] = Counter()
        dense: Counter[str] = Counter()

        def plain(what: str, rows: int, cols: int, times: int = 1) -> None:
            dense[what] += rows * cols * item * times

        def proj(what: str, rows: int, cols: int, times: int = 1, fp8_ok: bool = True) -> None:
            """A projection DeepSeek ships in FP8 (stays FP8 with fp32 block scales when kept)."""
            if not (self.fp8 and fp8_ok):
                plain(what, rows, cols, times)
                return
            scales = math.ceil(rows / FP8_BLOCK) * math.ceil(cols / FP8_BLOCK) * 4
            fp8[what] += (rows * cols + scales) * times

        h, heads, inter = c.hidden_size, c.num_attention_heads, c.moe_intermediate_size

        def layer(i: int) -> None:
            if c.q_lora_rank:
                proj("attention", c.q_lora_rank, h)
                plain("norms + router", 1, c.q_lora_rank)
                proj("attention", heads * c.qk_head_dim, c.q_lora_rank)
            else:
                proj("attention", heads * c.qk_head_dim, h)
            proj("attention", c.kv_cache_dim, h)
            plain("norms + router", 1, c.kv_lora_rank)
            proj("attention", heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)
            proj("attention", h, heads * c.v_head_dim)
            if self.fp8:  # absorbed MLA keeps a dequantized kv_b_proj
                plain("absorbed kv_b copy", heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)
            if c.is_sparse:  # V3.2's indexer: FP8 wq_b and wk, the key norm, high-precision head weights
                assert c.index_n_heads and c.index_head_dim and c.q_lora_rank
                proj("attention", c.index_n_heads * c.index_head_dim, c.q_lora_rank)
                proj("attention", c.index_head_dim, h)
                plain("norms + router", 2, c.index_head_dim)
                plain("attention", c.index_n_heads, h)
            plain("norms + router", 2, h)
            if not c.is_moe_layer(i):
                proj("dense MLP", c.intermediate_size, h, times=3)
                return
            plain("norms + router", c.n_routed_experts, h)
            dense["norms + router"] += c.n_routed_experts * 4  # e_score_correction_bias (fp32)
            proj("routed experts", inter, h, times=3 * routed, fp8_ok=inter % FP8_BLOCK == 0)
            if c.n_shared_experts:
                proj("shared experts", inter * c.n_shared_experts, h, times=3)

        plain("embedding + lm_head", c.vocab_size, h, times=2)
        plain("norms + router", 1, h)  # final norm
        for i in range(c.num_hidden_layers):
            layer(i)
        for j in range(self.mtp_layers):  # own embedding, enorm, hnorm, eh_proj, layer, norm, shared head
            plain("embedding + lm_head", c.vocab_size, h, times=2)
            plain("norms + router", 3, h)
            plain("MTP eh_proj", h, 2 * h)
            layer(c.num_hidden_layers + j)
        return WeightBytes(dict(fp8), dict(dense))
