"""ModelConfig: both RoPE spellings, presets, Kimi-K2, and clear errors for configs dsinfer cannot run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dsinfer.base.config import ConfigError, ModelConfig
from dsinfer.base.presets import presets_dir, resolve_model

YARN = {"factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0}  # fmt: skip


def _v3(**changes: Any) -> dict[str, Any]:
    data = json.loads((presets_dir() / "deepseek-v3" / "config.json").read_text())
    data.update(changes)
    return data


@pytest.mark.parametrize("name", ["deepseek-v3", "kimi-k2", "tiny"])
def test_presets_load(name: str) -> None:
    path, is_preset = resolve_model(name)
    assert is_preset
    config = ModelConfig.from_file(path / "config.json")
    assert config.kv_cache_dim == 576


def test_deepseek_v3_derived_values() -> None:
    config = ModelConfig.from_dict(_v3())
    assert config.qk_head_dim == 192
    assert config.rope.type == "yarn" and config.rope.factor == 40
    # softmax scale = 192^-0.5 * (0.1 * ln 40 + 1)^2
    assert config.softmax_scale == pytest.approx(192**-0.5 * (0.1 * 3.6888794541139363 + 1) ** 2)
    assert config.rope.attention_factor == 1.0
    assert config.num_nextn_predict_layers == 1
    assert config.is_fp8 and config.is_moe_layer(3) and not config.is_moe_layer(2) and config.is_moe_layer(61)


def test_rope_scaling_and_rope_parameters_agree() -> None:
    old = ModelConfig.from_dict(_v3(rope_scaling={"type": "yarn", **YARN}))
    new_data = _v3(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, **YARN})
    del new_data["rope_scaling"], new_data["rope_theta"]
    assert ModelConfig.from_dict(new_data).rope == old.rope


def test_yarn_factor_defaults_to_length_ratio() -> None:
    config = ModelConfig.from_dict(
        _v3(
            rope_scaling={"type": "yarn", "original_max_position_embeddings": 4096},
            max_position_embeddings=163840,
        )
    )
    assert config.rope.factor == 40.0


def test_null_q_lora_rank_and_mtp_alias() -> None:
    data = _v3(q_lora_rank=None, num_mtp_layers=2)
    del data["num_nextn_predict_layers"]
    config = ModelConfig.from_dict(data)
    assert config.q_lora_rank is None and config.num_nextn_predict_layers == 2


def test_kimi_k2_config_accepted() -> None:
    config = ModelConfig.from_file(presets_dir() / "kimi-k2" / "config.json")
    assert config.model_type == "kimi_k2" and config.n_routed_experts == 384 and config.n_group == 1


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"model_type": "llama"}, r"model_type 'llama' \(DeepseekV3ForCausalLM\) is not supported"),
        ({"architectures": ["LlamaForCausalLM"]}, "LlamaForCausalLM"),
        ({"n_group": 7}, "n_routed_experts must be divisible by n_group"),
        ({"topk_group": 9}, "topk_group must be in"),
        ({"num_experts_per_tok": 200}, "num_experts_per_tok must fit"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"topk_method": "greedy"}, "topk_method"),
        ({"hidden_size": "big"}, "hidden_size"),
        ({"kv_lora_rank": 0}, "kv_lora_rank must be positive"),
        (
            {"quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 64]}},
            "weight_block_size",
        ),
    ],
)
def test_bad_config_names_the_field(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict(_v3(**changes))


def test_missing_field_and_bad_json(tmp_path: Path) -> None:
    data = _v3()
    del data["kv_lora_rank"]
    with pytest.raises(ConfigError, match="kv_lora_rank: Field required"):
        ModelConfig.from_dict(data)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_file(tmp_path / "config.json")
    with pytest.raises(ConfigError, match="no such config file"):
        ModelConfig.from_file(tmp_path / "missing.json")


# Parts of Qwen3-MoE's config.json: fields that fail V3's validation.
QWEN = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
        "hidden_size": 4096, "num_hidden_layers": 94, "num_experts": 128}  # fmt: skip
# DeepSeek-V4's, read as V3's (by the commands that take the V3 family only)
V4 = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "vocab_size": 129280,
      "hidden_size": 7168, "num_hidden_layers": 61, "scoring_func": "sqrtsoftplus"}  # fmt: skip
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
         "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32}  # fmt: skip


def _refusal(data: dict[str, Any], tmp_path: Path) -> str:
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_file(tmp_path / "config.json")
    return str(info.value)


def test_unsupported_family_is_named_before_its_fields(tmp_path: Path) -> None:
    message = _refusal(QWEN, tmp_path)
    assert message == (
        f"{tmp_path / 'config.json'}: model_type 'qwen3_moe' (Qwen3MoeForCausalLM) is not supported; "
        "dsinfer serves deepseek_v3 (DeepSeek-V3/R1, V3.1), deepseek_v32 (DeepSeek-V3.2), kimi_k2 (Kimi-K2) "
        "and deepseek_v4 (DeepSeek-V4)"
    )
    assert _refusal(V4, tmp_path).endswith(
        "DeepSeek-V4 (model_type 'deepseek_v4') is served without MTP, elastic EP, EPLB "
        "and the simulator for now: they take the V3 family only"
    )
    llama = _refusal(LLAMA, tmp_path)
    assert "model_type 'llama' (LlamaForCausalLM) is not supported; dsinfer serves" in llama


def test_unsupported_architecture_of_a_supported_type(tmp_path: Path) -> None:
    message = _refusal(_v3(architectures=["DeepseekV4ForCausalLM"]), tmp_path)
    assert message.endswith(
        "architecture DeepseekV4ForCausalLM (model_type 'deepseek_v3') is not supported; "
        "dsinfer serves DeepseekV3ForCausalLM and DeepseekV32ForCausalLM"
    )
    unnamed = {k: v for k, v in LLAMA.items() if k != "model_type"}
    assert "architecture LlamaForCausalLM (model_type 'deepseek_v3')" in _refusal(unnamed, tmp_path)


def test_missing_model_type_is_read_as_deepseek_v3(tmp_path: Path) -> None:
    """Accepted when its fields validate; when they do not, the message says how it was read."""
    data = {k: v for k, v in _v3().items() if k != "model_type"}
    assert ModelConfig.from_dict(data).model_type == "deepseek_v3"
    del data["kv_lora_rank"]
    message = _refusal(data, tmp_path)
    assert "no model_type (read as deepseek_v3): kv_lora_rank: Field required" in message


def test_supported_type_keeps_its_field_errors(tmp_path: Path) -> None:
    data = _v3(scoring_func="softmax")
    del data["intermediate_size"]
    message = _refusal(data, tmp_path)
    assert "intermediate_size: Field required" in message and "scoring_func: Input should be" in message
    assert "not supported" not in message and "model_type" not in message
