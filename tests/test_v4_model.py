"""DeepSeek-V4's model layer against transformers' DeepseekV4ForCausalLM on the same random weights.

Tiny checkpoints written by transformers cover every layer type (sliding only, CSA with its
indexer, HCA), hash-routed and routed MoE layers and mHC streams, with a sliding window and
compression rates far below the prompt lengths and ``index_topk`` below the number of compressed
entries. Logits are compared for whole prompts, for prompts fed in chunks that end mid-window and
mid-compression-block, and token by token; greedy continuations must be equal. The indexer has 8
heads: with fewer, ReLU zeros tie at the top-k boundary and transformers itself picks differently
with and without its cache.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from dsinfer.base.v4_config import CSA, HCA, SLIDING, V4Config
from dsinfer.model.deepseek_v4 import DeepseekV4ForCausalLM, checkpoint_key, load_v4
from dsinfer.ops import select_ops

transformers = pytest.importorskip("transformers")

VOCAB = 320
BASE: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, moe_intermediate_size=32, num_attention_heads=4, head_dim=32,
    q_lora_rank=32, num_experts_per_tok=2, n_routed_experts=8, o_groups=2, o_lora_rank=16,
    index_n_heads=8, index_head_dim=16, partial_rotary_factor=0.25, max_position_embeddings=4096,
    rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 64,
                     "beta_fast": 32, "beta_slow": 1},
)  # fmt: skip
CONFIGS: dict[str, dict[str, Any]] = {
    # V4-Flash's pattern: sliding-only layers first, hash layers, then CSA and HCA alternating
    "flash_like": dict(
        num_hidden_layers=5, layer_types=[SLIDING, SLIDING, CSA, HCA, CSA],
        mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe", "moe"], compress_rates={CSA: 4, HCA: 16},
        sliding_window=8, index_topk=3, hc_mult=4,
    ),
    # V4-Pro's: no sliding-only layer, HCA first; a wider window, another rate, two streams
    "pro_like": dict(
        num_hidden_layers=4, layer_types=[HCA, HCA, CSA, HCA], mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        compress_rates={CSA: 4, HCA: 8}, sliding_window=12, index_topk=5, hc_mult=2,
    ),
}  # fmt: skip


def _build(name: str, directory: Path) -> Any:
    config = transformers.DeepseekV4Config(**BASE, **CONFIGS[name])
    torch.manual_seed(0)
    model = transformers.DeepseekV4ForCausalLM(config).eval()
    with torch.no_grad():  # what initialisation leaves at zero or one, random like trained weights
        for key, param in model.named_parameters():
            if any(part in key for part in ("position_bias", "sinks", "base", "scale")):
                param.normal_(0, 0.5)
        for key, buffer in model.named_buffers():
            if "tid2eid" in key:
                buffer.copy_(torch.randint(0, config.n_routed_experts, buffer.shape))
            elif "e_score_correction_bias" in key:
                buffer.normal_(0, 0.1)
    model.save_pretrained(directory)
    return model


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Any, DeepseekV4ForCausalLM]:
    directory = tmp_path_factory.mktemp(f"v4_{request.param}")
    reference = _build(request.param, directory)
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
    keys), and the rows of the unfinished block (CSA: plus the last block's first half)."""
    _, model = pair
    config, length, itemsize = model.config, 203, 4
    state = model.new_state()
    model(_prompt(length, 5), state)
    expected = {"window": 0, "compressed": 0, "indexer": 0, "compressor_state": 0}
    for layer, kind in enumerate(config.layer_types):
        expected["window"] += min(length, config.sliding_window - 1) * config.head_dim * itemsize
        if kind == SLIDING:
            continue
        rate = config.compress_rate(layer)
        dims = [(config.head_dim, "compressed")] + (
            [(config.index_head_dim, "indexer")] if kind == CSA else []
        )
        for dim, group in dims:
            expected[group] += (length // rate) * dim * itemsize
            width = 2 * dim if kind == CSA else dim
            pending = 2 * (length % rate) * width  # kv and gate rows of the unfinished block
            overlap = 2 * rate * dim if kind == CSA else 0  # kv and gate of the last block's first half
            expected["compressor_state"] += (pending + overlap) * itemsize
    assert state.nbytes() == expected


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
