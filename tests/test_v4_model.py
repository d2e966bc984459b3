"""DeepSeek-V4's model layer against transformers' DeepseekV4ForCausalLM on the same random weights.

Tiny checkpoints written by transformers (harness/v4_checkpoints.py) cover every layer type,
hash-routed and routed MoE layers and mHC streams. Logits are compared for whole prompts, for
prompts fed in chunks that end mid-window and mid-compression-block, and token by token; greedy
continuations must be equal.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsinfer.base.config import ConfigError, ModelConfig
from dsinfer.base.presets import resolve_model
from dsinfer.base.v4_config import CSA, HCA, SLIDING, V4Config
from dsinfer.model.deepseek_v4 import DeepseekV4ForCausalLM
from dsinfer.model.v4_loader import checkpoint_key, load_v4
from dsinfer.model.v4_state import cache_bytes
from dsinfer.ops import Ops, select_ops
from dsinfer.ops.fp8 import dequantize_weight_128x128, quantize_weight_128x128
from dsinfer.ops.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from harness.v4_checkpoints import CONFIGS, VOCAB, build_v4

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Any, DeepseekV4ForCausalLM]:
    directory = tmp_path_factory.mktemp(f"v4_{request.param}")
    reference = build_v4(request.param, directory)
    return reference, load_v4(directory, select_ops("cpu", "torch"))


def _prompt(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def _reference_logits(reference: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return reference(ids[None]).logits[0]


def _close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("length", [8, 37, 130, 400])
def test_prompt_logits_match_transformers(pair: tuple[Any, DeepseekV4ForCausalLM], length: int) -> None:
    reference, model = pair
    ids = _prompt(length, length)
    state = model.new_state()
    _close(model.compute_logits(model(ids, state)), _reference_logits(reference, ids))
    assert state.length == length


def test_chunks_and_decode_steps_match_one_forward(pair: tuple[Any, DeepseekV4ForCausalLM]) -> None:
    """Chunks ending mid-window (8/12) and mid-block (4, 8, 16), then tokens one at a time."""
    reference, model = pair
    ids = _prompt(150, 7)
    state, outputs, start = model.new_state(), [], 0
    for end in [13, 14, 31, 50, 67, 101, *range(102, 151)]:
        outputs.append(model.compute_logits(model(ids[start:end], state)))
        start = end
    _close(torch.cat(outputs), _reference_logits(reference, ids))


def test_first_chunk_shorter_than_the_window(pair: tuple[Any, DeepseekV4ForCausalLM]) -> None:
    """A first chunk of any length below the window keeps every row of it (a negative slice
    once kept only the last few), then three tokens cross the window's edge."""
    _, model = pair
    ids = _prompt(40, 11)
    whole = model.compute_logits(model(ids, model.new_state()))
    for split in range(1, 2 * model.config.sliding_window):
        state = model.new_state()
        model(ids[:split], state)
        _close(model.compute_logits(model(ids[split : split + 3], state)), whole[split : split + 3])


def test_greedy_continuation_equals_transformers(pair: tuple[Any, DeepseekV4ForCausalLM]) -> None:
    reference, model = pair
    prompt = _prompt(45, 3)
    with torch.no_grad():
        theirs = reference.generate(prompt[None], max_new_tokens=24, do_sample=False)[0, 45:].tolist()
    state = model.new_state()
    token, ours = model.compute_logits(model(prompt, state))[-1].argmax().item(), []
    for _ in range(24):
        ours.append(token)
        token = model.compute_logits(model(torch.tensor([token]), state))[-1].argmax().item()
    assert ours == theirs


def test_state_holds_what_each_group_needs(pair: tuple[Any, DeepseekV4ForCausalLM]) -> None:
    """Per layer: the last window - 1 raw rows, one entry per complete block (CSA also its indexer
    keys), and the rows of the unfinished block (CSA: plus the last block's first half). The state's
    tensors hold what a memory plan counts from the config alone, before a block is complete too."""
    _, model = pair
    config, itemsize = model.config, 4
    for length in (3, 130, 203):
        state = model.new_state()
        model(_prompt(length, 5), state)
        assert state.nbytes() == cache_bytes(config, length, itemsize), length
    window = config.num_hidden_layers * (config.sliding_window - 1) * config.head_dim * itemsize
    assert state.nbytes()["window"] == window
    assert state.nbytes()["compressed"] > 0 and state.nbytes()["indexer"] > 0


def test_release_layout_config_and_names() -> None:
    """DeepSeek's release spells the config and tensors its own way; both read the same."""
    release = {
        "vocab_size": 320, "hidden_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 4,
        "num_attention_heads": 4, "head_dim": 32, "qk_rope_head_dim": 8, "q_lora_rank": 32, "o_groups": 2,
        "o_lora_rank": 16, "compress_ratios": [0, 4, 128, 4], "num_hash_layers": 1, "sliding_window": 8,
        "index_n_heads": 8, "index_head_dim": 16, "index_topk": 3, "hc_mult": 4, "n_routed_experts": 8,
        "num_experts_per_tok": 2, "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1},
    }  # fmt: skip
    config = V4Config.model_validate(release)
    assert config.layer_types == (SLIDING, CSA, HCA, CSA)
    assert config.mlp_layer_types == ("hash_moe", "moe", "moe", "moe")
    assert config.compress_rate(2) == 128 and config.compress_rate(0) == 0
    assert config.rope(0).theta == 10000.0 and config.rope(0).type == "default"
    assert config.rope(1).theta == 160000.0 and config.rope(1).factor == 16
    assert config.rope(1).attention_factor == 1.0  # never YaRN's mscale in V4
    assert checkpoint_key("model.embed_tokens.weight") == "embed.weight"
    assert checkpoint_key("hc_head_fn") == checkpoint_key("model.hc_head.hc_fn") == "hc_head.fn"
    assert checkpoint_key("layers.3.hc_ffn_scale") == "layers.3.ffn_hc.scale"
    with pytest.raises(ValueError, match="layer_types has 3 entries for 4 layers"):
        V4Config.model_validate({**release, "compress_ratios": [0, 4, 128]})


FP8_LINEAR = re.compile(r"\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|shared_experts\.w[123])\.weight$")
ROUTED = re.compile(r"\.experts\.\d+\.w[123]\.weight$")


def _release_quantized(source: Path, quantized: Path, dequantized: Path) -> None:
    """The checkpoint as DeepSeek releases V4: attention and shared-expert weights FP8 e4m3 with
    one power-of-two (e8m0) scale per 128x128 block under ``<module>.scale``, routed experts MXFP4;
    and the same weights dequantized back to float32, which the quantized checkpoint must match."""
    tensors = load_file(source / "model.safetensors")
    low, high = {}, {}
    for name, tensor in tensors.items():
        stem = name.removesuffix(".weight")
        if FP8_LINEAR.search(name):
            _, scale = quantize_weight_128x128(tensor)
            scale = torch.exp2(torch.ceil(torch.log2(scale)))  # ue8m0: a power of two, rounded up
            rows, cols = tensor.shape
            expanded = scale.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
            low[name] = (tensor / expanded).to(torch.float8_e4m3fn)
            low[f"{stem}.scale"] = scale.to(torch.float8_e8m0fnu)
            high[name] = dequantize_weight_128x128(low[name], scale)
        elif ROUTED.search(name):
            low[name], low[f"{stem}.scale"] = quantize_mxfp4(tensor)
            high[name] = dequantize_mxfp4(low[name], low[f"{stem}.scale"])
        else:
            low[name] = high[name] = tensor
    for directory, weights in ((quantized, low), (dequantized, high)):
        directory.mkdir()
        shutil.copy(source / "config.json", directory / "config.json")
        save_file(weights, directory / "model.safetensors")


@pytest.mark.parametrize(
    ("preset", "layers", "first"),
    [("deepseek-v4-flash", 43, (SLIDING, SLIDING, CSA, HCA)), ("deepseek-v4-pro", 61, (HCA, HCA, HCA, CSA))],
)
def test_presets_are_the_released_configs(preset: str, layers: int, first: tuple[str, ...]) -> None:
    config = V4Config.model_validate(json.loads((resolve_model(preset)[0] / "config.json").read_text()))
    assert config.num_hidden_layers == layers and config.layer_types[:4] == first
    assert config.mlp_layer_types[:4] == ("hash_moe", "hash_moe", "hash_moe", "moe")
    assert (config.sliding_window, config.index_topk, config.hc_mult, config.num_experts_per_tok) == (
        128,
        512,
        4,
        6,
    )
    assert config.compress_rope.theta == 160000 and config.main_rope.theta == 10000
    with pytest.raises(ConfigError, match="deepseek_v4"):  # the engine does not serve V4 yet: one clear line
        ModelConfig.from_file(resolve_model(preset)[0] / "config.json")


def _release_logits(tmp_path: Path) -> tuple[Ops, torch.Tensor, torch.Tensor]:
    """The release-quantized checkpoint under ``tmp_path / "fp8"``: the reference ops, a prompt
    and the dequantized checkpoint's logits for it."""
    build_v4("flash_like", tmp_path / "hf")
    _release_quantized(tmp_path / "hf", tmp_path / "fp8", tmp_path / "dequantized")
    ops = select_ops("cpu", "torch")
    reference = load_v4(tmp_path / "dequantized", ops)
    ids = _prompt(60, 11)
    return ops, ids, reference.compute_logits(reference(ids, reference.new_state()))


def test_fp8_and_mxfp4_release_weights(tmp_path: Path) -> None:
    ops, ids, expected = _release_logits(tmp_path)
    dequantized = load_v4(tmp_path / "fp8", ops)  # the CPU's ops run no FP8 GEMM: dequantized at load
    assert dequantized.layers[0].attn.wq_a.weight.dtype == torch.float32
    _close(dequantized.compute_logits(dequantized(ids, dequantized.new_state())), expected)
    kept = load_v4(tmp_path / "fp8", dataclasses.replace(ops, supports_fp8_gemm=True))
    wq_a = kept.layers[0].attn.wq_a
    assert wq_a.weight.dtype == torch.float8_e4m3fn and wq_a.weight_scale_inv is not None
    exponents = torch.log2(wq_a.weight_scale_inv)
    assert torch.equal(exponents, exponents.round())  # e8m0: powers of two
    # activations are quantized 1x128 as well in the FP8 GEMMs: the logits follow only statistically
    got = kept.compute_logits(kept(ids, kept.new_state()))
    cosine = torch.nn.functional.cosine_similarity(got, expected, dim=-1)
    assert cosine.median() > 0.98 and cosine.min() > 0.8, cosine


def test_mxfp4_experts_kept_packed(tmp_path: Path) -> None:
    """MXFP4 experts kept packed (as on a GPU with the MXFP4 GEMM kernel; here through its torch
    reference) hold a quarter of float32's bytes per value plus their scales, and give the
    dequantized checkpoint's logits; a checkpoint without MXFP4 experts cannot be kept packed."""
    ops, ids, expected = _release_logits(tmp_path)
    assert not load_v4(tmp_path / "fp8", ops).layers[3].ffn.mxfp4  # the reference backend: dequantized
    packed = load_v4(tmp_path / "fp8", ops, keep_mxfp4=True)
    moe = packed.layers[3].ffn
    assert moe.mxfp4 and moe.w13.dtype == torch.uint8 and moe.w13_scale.dtype == torch.uint8
    config = packed.config
    assert (
        moe.w13.numel() * 2 == config.n_routed_experts * 2 * config.moe_intermediate_size * config.hidden_size
    )
    _close(packed.compute_logits(packed(ids, packed.new_state())), expected)
    with pytest.raises(ValueError, match="not MXFP4"):
        load_v4(tmp_path / "dequantized", ops, keep_mxfp4=True)


def test_mxfp4_round_trip() -> None:
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0] * 4)
    exact = torch.stack([grid, -grid * 0.25, grid * 8.0])  # each row one block, scales 1, 1/4, 8
    packed, scale = quantize_mxfp4(exact)
    assert packed.dtype == torch.uint8 and tuple(packed.shape) == (3, 16) and tuple(scale.shape) == (3, 1)
    assert torch.equal(dequantize_mxfp4(packed, scale), exact)
    assert torch.equal(dequantize_mxfp4(packed, scale.view(torch.uint8)), exact)  # scales as raw bytes
    noisy = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    error = (dequantize_mxfp4(*quantize_mxfp4(noisy)) - noisy).abs()
    assert error.max() <= noisy.abs().max() / 4  # half the widest e2m1 step (2) at the block's scale
