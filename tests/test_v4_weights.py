"""DeepSeek-V4's weight count from its config (dsinfer/base/v4_weights.py) against the model
itself, built on the meta device: every parameter counted once, in the kind the loader keeps it."""

from __future__ import annotations

import pytest
import torch

from dsinfer.base.model_config import read_model_config
from dsinfer.base.presets import resolve_model
from dsinfer.base.v4_config import V4Config
from dsinfer.base.v4_weights import V4ParameterCounts
from dsinfer.model.deepseek_v4 import DeepseekV4ForCausalLM
from dsinfer.model.layers import Linear
from dsinfer.ops import select_ops
from harness.v4_checkpoints import BASE, CONFIGS


def _model_counts(config: V4Config, mtp_layers: int) -> tuple[list[int], int, int]:
    """(linear weights but the head's, routed experts, the rest) of the meta-device model."""
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(config, select_ops("cpu", quiet=True), num_mtp_layers=mtp_layers)
    linear_names = {
        f"{name}.weight"
        for name, module in model.named_modules()
        if isinstance(module, Linear) and name != "head"
    }
    linear, experts, other = [], 0, 0
    for name, param in model.named_parameters():
        if name.endswith((".ffn.w13", ".ffn.w2")):
            experts += param.numel()
        elif name in linear_names:
            linear.append(param.numel())
        else:
            other += param.numel()
    return linear, experts, other


def _tiny(name: str) -> V4Config:
    import transformers

    hf = transformers.DeepseekV4Config(**{**BASE, **CONFIGS[name]})
    return V4Config.model_validate(hf.to_dict())


@pytest.mark.parametrize("mtp_layers", [0, 1])
@pytest.mark.parametrize("name", ["deepseek-v4-flash", "deepseek-v4-pro", "flash_like", "pro_like"])
def test_counts_equal_the_model(name: str, mtp_layers: int) -> None:
    config = _tiny(name) if name in CONFIGS else read_model_config(resolve_model(name)[0] / "config.json")
    assert isinstance(config, V4Config)
    linear, experts, other = _model_counts(config, mtp_layers)
    counts = V4ParameterCounts.of(config, mtp_layers)
    assert sorted(counts.linear) == sorted(linear)
    assert (counts.experts, counts.other) == (experts, other)


def test_bytes_by_precision() -> None:
    config = read_model_config(resolve_model("deepseek-v4-flash")[0] / "config.json")
    assert isinstance(config, V4Config)
    counts = V4ParameterCounts.of(config)
    cpu = counts.on_rank(2, fp8=False)
    assert cpu.fp8 == 0 and cpu.total == 2 * (sum(counts.linear) + counts.experts + counts.other)
    gpu = counts.on_rank(2, fp8=True, mxfp4=True, share=0.5)
    # one byte per FP8 value and a 4-byte scale per 128x128 block; packed experts, half of them
    assert sum(counts.linear) < gpu.fp8 < sum(counts.linear) * (1 + 4 / 128**2) + 4 * len(counts.linear)
    assert gpu.experts == round(counts.experts * (0.5 + 1 / 32) * 0.5)
    assert gpu.other == 2 * counts.other
