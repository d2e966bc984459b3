"""The model dimensions the cost model needs, under the cost model's short names, read from a
validated ``ModelConfig`` (kept as ``config``: weight and KV bytes per rank are counted by
``dsinfer.base.rank_shape.RankShape``, as the memory plan counts them), or from a ``V4Config``
(``v4``: its layer kinds and hybrid cache, dsinfer/base/kv_groups.py; weights by
dsinfer/base/v4_weights.py)."""

from __future__ import annotations

from dataclasses import dataclass

from dsinfer.base.config import PAGE_SIZE, ModelConfig
from dsinfer.base.kv_groups import HybridCacheSpec
from dsinfer.base.kv_spec import KVCacheSpec
from dsinfer.base.model_config import read_model_config
from dsinfer.base.presets import resolve_model
from dsinfer.base.v4_config import CSA, HCA, V4Config

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
class V4Dims:
    """What DeepSeek-V4 adds: per layer its attention kind, and the hybrid cache (model dtype, as the
    engine keeps it) whose window and compressor state each running sequence holds whatever its length."""

    config: V4Config
    cache: HybridCacheSpec
    kinds: tuple[str, ...]  # per layer: sliding_attention, CSA or HCA
    hash_layers: int  # the first layers route by token id: no router GEMM
    head_dim: int
    o_groups: int
    o_lora: int
    window: int
    csa_rate: int
    hca_rate: int
    hc_mult: int

    @classmethod
    def from_config(cls, cfg: V4Config) -> V4Dims:
        return cls(
            config=cfg,
            cache=HybridCacheSpec.for_v4(cfg, "bfloat16"),
            kinds=cfg.layer_types,
            hash_layers=sum(cfg.is_hash_layer(i) for i in range(cfg.num_hidden_layers)),
            head_dim=cfg.head_dim,
            o_groups=cfg.o_groups,
            o_lora=cfg.o_lora_rank,
            window=cfg.sliding_window,
            csa_rate=cfg.compress_rates[CSA],
            hca_rate=cfg.compress_rates[HCA],
            hc_mult=cfg.hc_mult,
        )


@dataclass(frozen=True)
class ModelShape:
    config: ModelConfig | V4Config
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
    page_tokens: int = PAGE_SIZE  # tokens per KV page
    v4: V4Dims | None = None

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
    def from_v4(cls, cfg: V4Config) -> ModelShape:
        """V4 under the same names (``kv_lora`` 0: no latent; ``v_dim`` the shared K=V head; every
        layer MoE, the hash layers too); ``cache_bytes_per_layer`` is a page's charge per token and
        layer (the compressed entries and indexer keys; the window is each sequence's bounded part)."""
        dims = V4Dims.from_config(cfg)
        layers = cfg.num_hidden_layers
        per_layer = -(-dims.cache.charged_page_bytes // (dims.cache.page_tokens * layers))
        return cls(
            config=cfg,
            hidden=cfg.hidden_size,
            vocab=cfg.vocab_size,
            layers=layers,
            dense_layers=0,
            heads=cfg.num_attention_heads,
            q_lora=cfg.q_lora_rank,
            kv_lora=0,
            rope_dim=cfg.qk_rope_head_dim,
            nope_dim=cfg.head_dim - cfg.qk_rope_head_dim,
            v_dim=cfg.head_dim,
            inter=cfg.moe_intermediate_size,
            moe_inter=cfg.moe_intermediate_size,
            experts=cfg.n_routed_experts,
            topk=cfg.num_experts_per_tok,
            n_group=1,
            topk_group=1,
            shared_experts=cfg.n_shared_experts,
            mtp_layers=cfg.num_nextn_predict_layers,
            cache_bytes_per_layer=per_layer,
            index_heads=cfg.index_n_heads,
            index_dim=cfg.index_head_dim,
            page_tokens=dims.cache.page_tokens,
            v4=dims,
        )

    @classmethod
    def preset(cls, name: str = "deepseek-v3") -> ModelShape:
        path, _ = resolve_model(name)
        config = read_model_config(path / "config.json")
        return cls.from_v4(config) if isinstance(config, V4Config) else cls.from_config(config)

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
    def attention_params(self) -> int:
        """One layer's MLA projections (q through its LoRA when the model has one)."""
        if self.q_lora:
            q = self.hidden * self.q_lora + self.q_lora * self.heads * self.qk_head
        else:
            q = self.hidden * self.heads * self.qk_head
        return (
            q
            + self.hidden * self.latent_dim
            + self.kv_lora * self.heads * (self.nope_dim + self.v_dim)
            + self.heads * self.v_dim * self.hidden
        )

    @property
    def expert_params(self) -> int:
        """One routed or shared expert (gate, up and down projections)."""
        return 3 * self.hidden * self.moe_inter

    @property
    def dense_ffn_params(self) -> int:
        return 3 * self.hidden * self.inter

    @property
    def active_params(self) -> int:
        """Parameters one token multiplies through (attention, dense/shared/top-k routed FFN, lm_head)."""
        moe = (self.shared_experts + self.topk) * self.expert_params
        return (
            self.layers * self.attention_params
            + self.dense_layers * self.dense_ffn_params
            + self.moe_layers * moe
            + self.vocab * self.hidden
        )
