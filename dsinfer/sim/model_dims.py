"""The model dimensions the cost model needs, under the cost model's short names, read from a
validated ``ModelConfig`` (kept as ``config``: weight and KV bytes per rank are counted by
``dsinfer.base.rank_shape.RankShape``, as the memory plan counts them)."""

from __future__ import annotations

from dataclasses import dataclass

from dsinfer.base.config import ModelConfig
from dsinfer.base.kv_spec import KVCacheSpec
from dsinfer.base.presets import resolve_model

SCALE_BLOCK = 128  # FP8 activation scales: one fp32 per 128 channels


# ModelShape field <- ModelConfig field
_CONFIG_NAMES = {
    "hidden": "hidden_size",
    "vocab": "vocab_size",
    "layers": "num_hidden_layers",
    "dense_layers": "first_k_dense_replace",
    "heads": "num_attention_heads",
    "kv_lora": "kv_lora_rank",
    "rope_dim": "qk_rope_head_dim",
    "nope_dim": "qk_nope_head_dim",
    "v_dim": "v_head_dim",
    "inter": "intermediate_size",
    "moe_inter": "moe_intermediate_size",
    "experts": "n_routed_experts",
    "topk": "num_experts_per_tok",
    "n_group": "n_group",
    "topk_group": "topk_group",
    "shared_experts": "n_shared_experts",
    "mtp_layers": "num_nextn_predict_layers",
}


@dataclass(frozen=True)
class ModelShape:
    config: ModelConfig
    hidden: int
    vocab: int
    layers: int
    dense_layers: int  # the first layers run a dense FFN instead of MoE
    heads: int
    q_lora: int  # 0 without a q LoRA
    kv_lora: int
    rope_dim: int
    nope_dim: int
    v_dim: int
    inter: int
    moe_inter: int
    experts: int
    topk: int
    n_group: int
    topk_group: int
    shared_experts: int
    mtp_layers: int
    # one token's cache in one layer as DeepSeek serves it: BF16 latent + (V3.2) FP8 indexer key
    cache_bytes_per_layer: int = 0
    index_heads: int = 0  # V3.2's lightning indexer (0: dense attention)
    index_dim: int = 0
    index_topk: int = 0

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> ModelShape:
        if cfg.moe_layer_freq != 1:
            raise ValueError(
                "the cost model assumes moe_layer_freq == 1 (every layer after the dense ones is MoE)"
            )
        sizes = {name: getattr(cfg, source) for name, source in _CONFIG_NAMES.items()}
        return cls(
            config=cfg,
            q_lora=cfg.q_lora_rank or 0,
            cache_bytes_per_layer=KVCacheSpec.for_model(cfg, "bfloat16", "fp8").bytes_per_token,
            index_heads=cfg.index_n_heads or 0,
            index_dim=cfg.index_head_dim or 0,
            index_topk=cfg.index_topk or 0,
            **sizes,
        )

    @classmethod
    def preset(cls, name: str = "deepseek-v3") -> ModelShape:
        path, _ = resolve_model(name)
        return cls.from_config(ModelConfig.from_file(path / "config.json"))

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers

    @property
    def qk_head(self) -> int:
        return self.nope_dim + self.rope_dim

    @property
    def latent_dim(self) -> int:
        """Values per token per layer of the latent KV cache (512 + 64 for V3)."""
        return self.kv_lora + self.rope_dim

    @property
    def sparse(self) -> bool:
        return self.index_topk > 0

    @property
    def indexer_bytes_per_key(self) -> int:
        """FP8 indexer key + its fp32 scale, per token per layer (0 for dense attention)."""
        return self.cache_bytes_per_layer - 2 * self.latent_dim

    @property
    def indexer_flops_per_pair(self) -> int:
        """V3.2's indexer logits, per (query, key) pair, one layer."""
        return 2 * self.index_heads * self.index_dim

    @property
    def dispatch_bytes(self) -> int:
        """One token's hidden state as DeepEP dispatches it: FP8 values + fp32 scales per 128."""
        return self.hidden + 4 * -(-self.hidden // SCALE_BLOCK)

    @property
    def combine_bytes(self) -> int:
        return 2 * self.hidden  # BF16

    @property
    def attention_flops_per_pair(self) -> int:
        """Prefill (decompressed MHA): QK^T over qk_head plus PV over v_dim, every head, one layer."""
        return 2 * self.heads * (self.qk_head + self.v_dim)

    @property
    def mla_decode_flops_per_key(self) -> int:
        """Absorbed MLA decode, per query token per cached key, one layer: QK over the 576-wide
        latent + rope, PV over the 512-wide latent, every head."""
        return 2 * self.heads * (self.latent_dim + self.kv_lora)

    @property
    def active_params(self) -> int:
        """Parameters one token multiplies through (attention, dense/shared/top-k routed FFN, lm_head)."""
        attn = (
            self.hidden * (self.q_lora + self.latent_dim)
            + self.q_lora * self.heads * self.qk_head
            + self.kv_lora * self.heads * (self.nope_dim + self.v_dim)
            + self.heads * self.v_dim * self.hidden
        )
        expert = 3 * self.hidden * self.moe_inter
        dense = 3 * self.hidden * self.inter
        moe = (self.shared_experts + self.topk) * expert
        return (
            self.layers * attn + self.dense_layers * dense + self.moe_layers * moe + self.vocab * self.hidden
        )
