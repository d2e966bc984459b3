"""Model configuration: a validated view of a Hugging Face DeepSeek-V3-architecture config.json.

Accepts DeepSeek-V3, R1, V3.1, V3.2 (model_type ``deepseek_v32``: DeepSeek Sparse Attention, whose
lightning indexer is described by ``index_n_heads``, ``index_head_dim`` and ``index_topk``),
Kimi-K2 (model_type ``kimi_k2``) and tiny test checkpoints. Both the old
``rope_scaling`` and the newer ``rope_parameters`` spellings are read. Anything the model code
cannot run is refused here, with the offending field named, instead of failing later in a kernel.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from dsinfer.base.documents import read_document

# model_type -> the models that config.json describes with it
FAMILIES = {"deepseek_v3": "DeepSeek-V3/R1, V3.1", "deepseek_v32": "DeepSeek-V3.2", "kimi_k2": "Kimi-K2"}
# read by dsinfer/base/model_config.py as V4Config, not as this module's ModelConfig
V4_MODEL_TYPE = "deepseek_v4"
V4_SCOPE = (
    "DeepSeek-V4 (model_type 'deepseek_v4') is served without MTP, elastic EP, EPLB "
    "and the simulator for now: they take the V3 family only"
)
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
SUPPORTED_ARCHITECTURES = ("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM")
DEFAULT_MODEL_TYPE = "deepseek_v3"  # what a config.json without model_type is read as
PAGE_SIZE = 64  # tokens per page of the latent KV cache (FlashMLA's block size)
# Choices of engine flags, here (no torch) so that a process that only parses them never loads torch.
LOAD_FORMATS = ("auto", "safetensors", "dummy")  # how dsinfer/model/loader.py reads a checkpoint
EP_BACKENDS: tuple[str, ...] = ("auto", "deepep", "torch")  # dsinfer/parallel/ep_select.py
TRANSFER_BACKENDS = ("nixl", "mooncake")  # dsinfer/transfer/factory.py
FP8_BLOCK = 128  # block edge of DeepSeek's FP8 weight scales


class ConfigError(ValueError):
    """A configuration that dsinfer cannot run; the message names the field."""


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


class RopeConfig(BaseModel):
    """RoPE over the qk_rope_head_dim channels; ``type == "yarn"`` enables YaRN scaling."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    type: Literal["default", "yarn"] = "default"
    theta: float = 10000.0
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    truncate: bool = True
    attention_factor_override: float | None = None  # a fixed multiplier on cos/sin (V4: 1.0)

    @property
    def attention_factor(self) -> float:
        """Multiplier on cos/sin (YaRN's mscale ratio)."""
        if self.attention_factor_override is not None:
            return self.attention_factor_override
        if self.type != "yarn":
            return 1.0
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    def softmax_scale(self, qk_head_dim: int) -> float:
        scale = qk_head_dim**-0.5
        if self.type == "yarn" and self.mscale_all_dim:
            scale *= yarn_mscale(self.factor, self.mscale_all_dim) ** 2
        return scale


class QuantConfig(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    quant_method: Literal["fp8"]
    fmt: Literal["e4m3"] = "e4m3"
    activation_scheme: Literal["dynamic"] = "dynamic"
    weight_block_size: tuple[int, int] = (FP8_BLOCK, FP8_BLOCK)

    @model_validator(mode="after")
    def _block(self) -> QuantConfig:
        if tuple(self.weight_block_size) != (FP8_BLOCK, FP8_BLOCK):
            raise ValueError(f"weight_block_size must be [128, 128], got {list(self.weight_block_size)}")
        return self


class ModelConfig(BaseModel):
    """The fields of config.json the model needs, validated for mutual consistency."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    model_type: str = DEFAULT_MODEL_TYPE
    architectures: tuple[str, ...] = ("DeepseekV3ForCausalLM",)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None = None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int = 1
    num_experts_per_tok: int
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    scoring_func: Literal["sigmoid"] = "sigmoid"
    topk_method: Literal["noaux_tc"] = "noaux_tc"
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    hidden_act: Literal["silu"] = "silu"
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    rope: RopeConfig = RopeConfig()
    rope_interleave: bool = True
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_id: int | tuple[int, ...] | None = 1
    num_nextn_predict_layers: int = 0
    # DeepSeek Sparse Attention (V3.2): set together, or all None for dense MLA
    index_topk: int | None = None  # keys each query attends to, chosen by the indexer
    index_n_heads: int | None = None
    index_head_dim: int | None = None
    initializer_range: float = 0.02  # std of dummy weights
    quantization_config: QuantConfig | None = None

    @model_validator(mode="before")
    @classmethod
    def _normalize(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        rope = data.pop("rope_parameters", None) or data.pop("rope_scaling", None) or {}
        rope = dict(rope)
        rope_type = rope.pop("rope_type", None) or rope.pop("type", None) or "default"
        rope["type"] = rope_type
        rope.setdefault("theta", rope.pop("rope_theta", None) or data.get("rope_theta", 10000.0))
        if rope_type == "yarn" and rope.get("factor") is None:
            orig = rope.get("original_max_position_embeddings") or 4096
            rope["factor"] = data.get("max_position_embeddings", orig) / orig
        data["rope"] = {k: v for k, v in rope.items() if v is not None}
        if "num_nextn_predict_layers" not in data and "num_mtp_layers" in data:
            data["num_nextn_predict_layers"] = data["num_mtp_layers"]
        return data

    @model_validator(mode="after")
    def _consistent(self) -> ModelConfig:
        problem = family_problem(self.model_type, self.architectures)
        if problem is not None:
            raise ValueError(problem)
        self._check_sparse_attention()
        checks = [
            (self.n_routed_experts % self.n_group == 0, "n_routed_experts must be divisible by n_group"),
            (1 <= self.topk_group <= self.n_group, "topk_group must be in [1, n_group]"),
            (
                1 <= self.num_experts_per_tok <= self.topk_group * (self.n_routed_experts // self.n_group),
                "num_experts_per_tok must fit in the experts of the selected groups",
            ),
            (
                self.n_routed_experts // self.n_group >= 2 or self.n_group == 1,
                "each expert group needs at least 2 experts (group score = sum of its top-2)",
            ),
            (0 <= self.first_k_dense_replace <= self.num_hidden_layers, "first_k_dense_replace out of range"),
            (self.moe_layer_freq >= 1, "moe_layer_freq must be >= 1"),
            (self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim must be even"),
            (self.num_nextn_predict_layers >= 0, "num_nextn_predict_layers must be >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
            "n_routed_experts",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        return self

    def _check_sparse_attention(self) -> None:
        fields = {
            "index_topk": self.index_topk,
            "index_n_heads": self.index_n_heads,
            "index_head_dim": self.index_head_dim,
        }
        given = [k for k, v in fields.items() if v is not None]
        if self.model_type == "deepseek_v32" and len(given) < len(fields):
            missing = [k for k in fields if k not in given]
            raise ValueError(
                f"model_type deepseek_v32 needs {', '.join(missing)} (DeepSeek Sparse Attention)"
            )
        if not given:
            return
        if len(given) < len(fields):
            raise ValueError(
                f"{', '.join(given)} given without {', '.join(k for k in fields if k not in given)}"
            )
        for name, value in fields.items():
            if value is None or value <= 0:
                raise ValueError(f"{name} must be positive")
        if self.q_lora_rank is None:
            raise ValueError("sparse attention needs q_lora_rank (the indexer's query comes from the q LoRA)")
        assert self.index_head_dim is not None
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ValueError(
                f"index_head_dim {self.index_head_dim} is smaller than qk_rope_head_dim {self.qk_rope_head_dim}"
            )

    # Derived sizes --------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Values per token per layer in the latent cache: kv_lora_rank + qk_rope_head_dim."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def is_sparse(self) -> bool:
        """DeepSeek Sparse Attention: a lightning indexer picks each query's ``index_topk`` keys."""
        return self.index_topk is not None

    @property
    def softmax_scale(self) -> float:
        return self.rope.softmax_scale(self.qk_head_dim)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        return (self.eos_token_id,) if isinstance(self.eos_token_id, int) else tuple(self.eos_token_id)

    @property
    def is_fp8(self) -> bool:
        return self.quantization_config is not None

    def is_moe_layer(self, layer: int) -> bool:
        """MTP layers (index >= num_hidden_layers) are always MoE."""
        if layer >= self.num_hidden_layers:
            return True
        return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0

    # Construction ---------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> ModelConfig:
        """The family (model_type, architectures) is checked first: a model dsinfer cannot serve is
        named in one line, not by the fields its config lacks."""
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: not a JSON object")
        problem = family_problem(data.get("model_type", DEFAULT_MODEL_TYPE), data.get("architectures", ()))
        if problem is not None:
            raise ConfigError(f"{source}: {problem}")
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            unnamed = "" if "model_type" in data else f"no model_type (read as {DEFAULT_MODEL_TYPE}): "
            raise ConfigError(f"{source}: {unnamed}{describe_validation(e)}") from None

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        data = read_document(path, "JSON", "config", ConfigError)
        return cls.from_dict(data, source=str(path))


def family_problem(model_type: object, architectures: object) -> str | None:
    """Why dsinfer cannot serve this model_type or architecture, or None when it can. Values of
    the wrong JSON type are left to the field validation."""
    listed = architectures if isinstance(architectures, list | tuple) else []
    names = [a for a in listed if isinstance(a, str)]
    if model_type == V4_MODEL_TYPE:
        return V4_SCOPE
    if isinstance(model_type, str) and model_type not in FAMILIES:
        built_as = f" ({', '.join(names)})" if names else ""
        return f"model_type {model_type!r}{built_as} is not supported; dsinfer serves {_families()}"
    unknown = [a for a in names if a not in SUPPORTED_ARCHITECTURES]
    if unknown:
        return (
            f"architecture {', '.join(unknown)} (model_type {model_type!r}) is not supported; "
            f"dsinfer serves {' and '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return None


def _families() -> str:
    served = {**FAMILIES, V4_MODEL_TYPE: "DeepSeek-V4"}
    named = [f"{model_type} ({models})" for model_type, models in served.items()]
    return f"{', '.join(named[:-1])} and {named[-1]}"


def describe_validation(error: ValidationError) -> str:
    parts = []
    for item in error.errors():
        where = ".".join(str(p) for p in item["loc"])
        message = item["msg"].removeprefix("Value error, ")
        parts.append(f"{where}: {message}" if where else message)
    return "; ".join(parts)
