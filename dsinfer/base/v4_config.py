"""DeepSeek-V4's config.json, validated: compressed sparse attention over a hybrid cache, mHC
residual streams, hash-routed and sqrt-softplus MoE.

Read from either layout the checkpoints ship: transformers' (``layer_types``, ``mlp_layer_types``,
``compress_rates``, ``rope_parameters`` keyed ``main``/``compress``, ``partial_rotary_factor``) or
DeepSeek's release (``compress_ratios`` per layer 0/4/128, ``num_hash_layers``,
``qk_rope_head_dim``, a flat ``rope_scaling``). Sliding-only layers rotate with ``rope_theta``;
layers with a compressor, their compressed entries and their indexer with ``compress_rope_theta``
and the YaRN parameters, without YaRN's attention factor (as DeepSeek's reference does).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, model_validator

from dsinfer.base.config import RopeConfig

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
RATIO_LAYER_TYPE = {0: SLIDING, 4: CSA, 128: HCA}  # the release's per-layer compress_ratios
HASH_MOE, MOE = "hash_moe", "moe"
DEFAULT_HASH_LAYERS = 3


class V4Config(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    model_type: Literal["deepseek_v4"] = "deepseek_v4"
    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: Literal[1] = 1  # one K=V head shared by every query head
    head_dim: int
    qk_rope_head_dim: int  # the trailing channels of each head that RoPE rotates
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    compress_rates: dict[str, int]  # CSA and HCA: source tokens per compressed entry
    sliding_window: int  # raw K=V tokens every layer attends to, itself included
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int  # residual streams (mHC)
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    n_routed_experts: int
    n_shared_experts: Literal[1] = 1
    num_experts_per_tok: int
    routed_scaling_factor: float = 1.0
    scoring_func: Literal["sqrtsoftplus", "sigmoid", "softmax"] = "sqrtsoftplus"
    swiglu_limit: float | None = None
    rms_norm_eps: float = 1e-6
    main_rope: RopeConfig
    compress_rope: RopeConfig
    max_position_embeddings: int = 1048576
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_id: int | tuple[int, ...] | None = 1
    num_nextn_predict_layers: int = 0
    expert_dtype: str | None = None  # the release's routed experts: "fp4" (MXFP4) in the instruct checkpoints

    @model_validator(mode="before")
    @classmethod
    def _normalize(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        layers = data.get("num_hidden_layers")
        ratios = data.get("compress_ratios")
        if data.get("layer_types") is None and ratios is not None:
            if isinstance(layers, int) and len(ratios) == layers + (
                data.get("num_nextn_predict_layers") or 0
            ):
                ratios = ratios[:layers]  # the release lists its MTP layer's too (0: its window only)
            data["layer_types"] = [RATIO_LAYER_TYPE.get(r, str(r)) for r in ratios]
        if data.get("mlp_layer_types") is None and isinstance(layers, int):
            hashed = data.get("num_hash_layers", DEFAULT_HASH_LAYERS)
            data["mlp_layer_types"] = [HASH_MOE] * min(layers, hashed) + [MOE] * max(0, layers - hashed)
        rates = {CSA: 4, HCA: 128, **(data.get("compress_rates") or {})}
        for name, key in ((CSA, "compress_rate_csa"), (HCA, "compress_rate_hca")):
            if data.get(key) is not None:
                rates[name] = data[key]
        data["compress_rates"] = rates
        head_dim = data.get("head_dim")
        if data.get("qk_rope_head_dim") is None and isinstance(head_dim, int):
            data["qk_rope_head_dim"] = int(head_dim * (data.get("partial_rotary_factor") or 64 / 512))
        data["main_rope"], data["compress_rope"] = _ropes(data)
        return data

    @model_validator(mode="after")
    def _consistent(self) -> V4Config:
        n = self.num_hidden_layers
        for name, types, allowed in (
            ("layer_types", self.layer_types, LAYER_TYPES),
            ("mlp_layer_types", self.mlp_layer_types, (HASH_MOE, MOE)),
        ):
            if len(types) != n:
                raise ValueError(f"{name} has {len(types)} entries for {n} layers")
            bad = sorted(set(types) - set(allowed))
            if bad:
                raise ValueError(f"{name}: {', '.join(bad)} unknown; expected {', '.join(allowed)}")
        checks = [
            (self.head_dim > self.qk_rope_head_dim > 0 and self.qk_rope_head_dim % 2 == 0,
             "qk_rope_head_dim must be even, positive and below head_dim"),
            ((self.num_attention_heads * self.head_dim) % self.o_groups == 0,
             "num_attention_heads * head_dim must divide into o_groups"),
            (self.index_head_dim > self.qk_rope_head_dim, "index_head_dim must exceed qk_rope_head_dim"),
            (all(self.compress_rates.get(t, 0) > 0 for t in (CSA, HCA)), "compress_rates must be positive"),
            (1 <= self.num_experts_per_tok <= self.n_routed_experts, "num_experts_per_tok out of range"),
            (self.sliding_window >= 1 and self.hc_mult >= 1 and self.index_topk >= 1,
             "sliding_window, hc_mult and index_topk must be positive"),
        ]  # fmt: skip
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        return self

    def layer_kind(self, layer: int) -> str:
        """``layer``'s attention kind; the MTP layers (indices from ``num_hidden_layers`` on, as in
        the release's ``compress_ratios``, whose extra entry is 0) attend over their window only."""
        return self.layer_types[layer] if layer < self.num_hidden_layers else SLIDING

    def compress_rate(self, layer: int) -> int:
        """Source tokens per compressed entry of ``layer`` (0: sliding only)."""
        return self.compress_rates.get(self.layer_kind(layer), 0)

    def rope(self, layer: int) -> RopeConfig:
        return self.main_rope if self.layer_kind(layer) == SLIDING else self.compress_rope

    def is_hash_layer(self, layer: int) -> bool:
        """The MTP layers route by their router."""
        return layer < self.num_hidden_layers and self.mlp_layer_types[layer] == HASH_MOE

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        return (self.eos_token_id,) if isinstance(self.eos_token_id, int) else tuple(self.eos_token_id)


def _ropes(data: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(main, compress) RoPE parameters from nested ``rope_parameters`` or a flat ``rope_scaling``."""
    nested = data.get("rope_parameters") or {}
    if isinstance(nested.get("main"), dict) and isinstance(nested.get("compress"), dict):
        main, compress = dict(nested["main"]), dict(nested["compress"])
    else:
        flat = dict(data.get("rope_scaling") or nested)
        main = {"rope_type": "default", "rope_theta": data.get("rope_theta", 10000.0)}
        compress = {**flat, "rope_theta": data.get("compress_rope_theta", 160000.0)}
    return _rope(main, data), _rope(compress, data)


def _rope(params: dict[str, Any], data: dict[str, Any]) -> dict[str, Any]:
    kind = params.get("rope_type") or params.get("type") or "default"
    rope: dict[str, Any] = {"type": kind, "theta": params.get("rope_theta", data.get("rope_theta", 10000.0))}
    if kind == "yarn":
        for key in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "truncate"):
            if params.get(key) is not None:
                rope[key] = params[key]
        rope["attention_factor_override"] = 1.0  # V4 never scales cos/sin by YaRN's mscale
    return rope
