"""The model dimensions the cost model needs, read from a validated ``ModelConfig``."""

from __future__ import annotations

from dataclasses import dataclass

from dsinfer.base.config import ModelConfig
from dsinfer.base.presets import resolve_model

SCALE_BLOCK = 128  # FP8 activation scales: one fp32 per 128 channels


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    vocab: int
    layers: int
    dense_layers: int  # the first layers run a dense FFN instead of MoE
    heads: int
    q_lora: int
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

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> ModelShape:
        if cfg.moe_layer_freq != 1:
            raise ValueError(
                "the cost model assumes moe_layer_freq == 1 (every layer after the dense ones is MoE)"
            )
        return cls(
            hidden=cfg.hidden_size,
            vocab=cfg.vocab_size,
            layers=cfg.num_hidden_layers,
            dense_layers=cfg.first_k_dense_replace,
            heads=cfg.num_attention_heads,
            q_lora=cfg.q_lora_rank or 0,
            kv_lora=cfg.kv_lora_rank,
            rope_dim=cfg.qk_rope_head_dim,
            nope_dim=cfg.qk_nope_head_dim,
            v_dim=cfg.v_head_dim,
            inter=cfg.intermediate_size,
            moe_inter=cfg.moe_intermediate_size,
            experts=cfg.n_routed_experts,
            topk=cfg.num_experts_per_tok,
            n_group=cfg.n_group,
            topk_group=cfg.topk_group,
            shared_experts=cfg.n_shared_experts,
            mtp_layers=cfg.num_nextn_predict_layers,
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

    def kv_bytes_per_token(self, mtp: bool) -> int:
        """BF16 latent cache bytes per token over every cache layer (+ the MTP layer's)."""
        return 2 * self.latent_dim * (self.layers + (self.mtp_layers if mtp else 0))

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
