"""A checkpoint's config.json read as the family it declares: DeepSeek-V4 (``model_type``
``deepseek_v4``) as ``V4Config``, every other family as V3's ``ModelConfig`` (which names, in one
line, a family dsinfer cannot serve)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ValidationError

from dsinfer.base.config import V4_MODEL_TYPE, ConfigError, ModelConfig, describe_validation
from dsinfer.base.documents import read_document
from dsinfer.base.v4_config import V4Config

AnyModelConfig = ModelConfig | V4Config


def read_model_config(path: str | Path) -> AnyModelConfig:
    path = Path(path)
    data = read_document(path, "JSON", "config", ConfigError)
    return model_config_from_dict(data, str(path))


def model_config_from_dict(data: Any, source: str = "config") -> AnyModelConfig:
    if isinstance(data, dict) and data.get("model_type") == V4_MODEL_TYPE:
        try:
            return V4Config.model_validate(data)
        except ValidationError as e:
            raise ConfigError(f"{source}: DeepSeek-V4 config: {describe_validation(e)}") from None
    return ModelConfig.from_dict(data, source)


def is_v4(config: AnyModelConfig) -> bool:
    return isinstance(config, V4Config)
