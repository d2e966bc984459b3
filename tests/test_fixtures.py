"""The test fixtures themselves: checkpoints on disk match the transformers reference."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import DeepseekV3ForCausalLM

from harness.checkpoints import (
    DELETE,
    ROPE_VARIANTS,
    TINY_BASE,
    TOKENIZER_DIR,
    TOKENIZER_FILES,
    BuiltCheckpoint,
    build_checkpoint,
    deepseek_style_config,
    dequantize_fp8_block,
    drop_tensor,
    is_fp8_weight,
    load_tensors,
    quantize_fp8_block,
    read_index,
    reshape_tensor,
    set_config_field,
    to_hf_memory_layout,
    truncate_shard,
)
from harness.hf_reference import (
    compare,
    compare_tokens,
    hf_decode_logits,
    hf_greedy_steps,
    hf_last_hidden,
    hf_logits,
    mtp_reference,
)

PROMPT = [5, 17, 300, 42, 4000, 7, 99, 1234, 8, 64, 512, 3]


def _reload(path: Path) -> DeepseekV3ForCausalLM:
    return DeepseekV3ForCausalLM.from_pretrained(path).eval()


def test_reload_gives_same_logits(tiny_ckpt: BuiltCheckpoint) -> None:
    ref = hf_logits(tiny_ckpt.hf_model, PROMPT)
    assert ref.shape == (len(PROMPT), TINY_BASE["vocab_size"])
    assert torch.equal(hf_logits(_reload(tiny_ckpt.path), PROMPT), ref)


def test_layout_and_index(tiny_ckpt: BuiltCheckpoint) -> None:
    index = read_index(tiny_ckpt.path)
    shards = sorted(set(index["weight_map"].values()))
    assert shards == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    on_disk: dict[str, str] = {}
    for shard in shards:
        with safe_open(tiny_ckpt.path / shard, "pt") as f:
            assert f.metadata() == {"format": "pt"}
            on_disk.update(dict.fromkeys(f.keys(), shard))
    assert on_disk == index["weight_map"]
    tensors = load_tensors(tiny_ckpt.path)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    assert all(t.dtype == torch.float32 for t in tensors.values())
    # DeepSeek's layout: per-expert tensors, dense layer 0, MTP at layer index num_hidden_layers
    h, n_layers = TINY_BASE["hidden_size"], TINY_BASE["num_hidden_layers"]
    assert tensors["model.layers.1.mlp.experts.7.gate_proj.weight"].shape == (
        TINY_BASE["moe_intermediate_size"],
        h,
    )
    assert "model.layers.0.mlp.gate_proj.weight" in tensors
    assert not any(".experts.gate_up_proj" in n for n in tensors)
    mtp = f"model.layers.{n_layers}."
    assert tensors[mtp + "eh_proj.weight"].shape == (h, 2 * h)
    assert tensors[mtp + "shared_head.head.weight"].shape == (TINY_BASE["vocab_size"], h)
    assert tiny_ckpt.mtp_state is not None and set(tiny_ckpt.mtp_state) == {
        n for n in tensors if n.startswith(mtp)
    }
    config = json.loads((tiny_ckpt.path / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1 and config["rope_parameters"]["rope_type"] == "yarn"
    for fname in TOKENIZER_FILES:  # copied when the tiny preset has them
        assert (tiny_ckpt.path / fname).exists() == (TOKENIZER_DIR / fname).exists()
    bias = tensors["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert (bias > 0).all() and (bias <= 0.5).all()


def test_fp8_checkpoint(tiny_ckpt_fp8: BuiltCheckpoint) -> None:
    tensors = load_tensors(tiny_ckpt_fp8.path)
    assert tiny_ckpt_fp8.config["quantization_config"]["weight_block_size"] == [128, 128]
    fp8 = [n for n in tensors if tensors[n].dtype == torch.float8_e4m3fn]
    assert fp8 and all(is_fp8_weight(n) for n in fp8)
    assert (
        "model.layers.3.self_attn.q_a_proj.weight" in fp8
        and "model.layers.1.mlp.experts.0.up_proj.weight" in fp8
    )
    for name in (
        "lm_head.weight",
        "model.embed_tokens.weight",
        "model.layers.1.mlp.gate.weight",
        "model.layers.3.eh_proj.weight",
    ):
        assert tensors[name].dtype == torch.float32
    for name in fp8:
        out_f, in_f = tensors[name].shape
        scale = tensors[name + "_scale_inv"]
        assert scale.dtype == torch.float32 and scale.shape == (math.ceil(out_f / 128), math.ceil(in_f / 128))
    assert not any(n.endswith("_scale_inv") and n[: -len("_scale_inv")] not in fp8 for n in tensors)
    # the reference model holds the dequantized weights; the transformers in-memory fusing agrees
    name = "model.layers.2.mlp.experts.5.down_proj.weight"
    deq = dequantize_fp8_block(tensors[name], tensors[name + "_scale_inv"])
    assert torch.equal(tiny_ckpt_fp8.hf_model.model.layers[2].mlp.experts.down_proj[5], deq)
    mtp_name = "model.layers.3.mlp.shared_experts.gate_proj.weight"
    assert tiny_ckpt_fp8.mtp_state is not None
    assert torch.equal(
        tiny_ckpt_fp8.mtp_state[mtp_name],
        dequantize_fp8_block(tensors[mtp_name], tensors[mtp_name + "_scale_inv"]),
    )


def test_fp8_quantizer_blocks() -> None:
    w = torch.randn(200, 130) * 0.05
    w[:128, 128:] = 0.0  # an all-zero partial block: amax clamps to 1e-4
    q, scale = quantize_fp8_block(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (2, 2)
    assert scale[0, 1] == pytest.approx(1e-4 / 448)
    assert scale[1, 0] == pytest.approx(float(w[128:, :128].abs().max()) / 448)
    assert q.float().abs().max() <= 448
    assert (dequantize_fp8_block(q, scale) - w).abs().max() <= 0.07 * w.abs().max()


def test_decode_matches_prefill(tiny_ckpt: BuiltCheckpoint) -> None:
    compare(hf_logits(tiny_ckpt.hf_model, PROMPT), hf_decode_logits(tiny_ckpt.hf_model, PROMPT))


def test_compare_policy() -> None:
    ref = torch.tensor([[10.0, -2.0, 3.0], [1.0, 0.5, -0.25]])
    compare(ref, ref + torch.tensor([[9e-4, 0, 0], [0, 9e-5, 0]]))
    with pytest.raises(AssertionError, match="worst position 1"):
        compare(ref, ref + torch.tensor([[9e-4, 0, 0], [0, 2e-4, 0]]))
    steps = torch.tensor([[1.0, 0.99995, 0.0], [1.0, 0.5, 0.0]])
    assert compare_tokens([0, 0], [0, 0], steps) is None
    assert compare_tokens([0, 0], [1, 0], steps) == 0  # margin 5e-5 < 2e-4 x 1: forgiven, stop
    with pytest.raises(AssertionError, match="token 1 differs"):
        compare_tokens([0, 0], [0, 1], steps)


def test_greedy_is_argmax_of_full_forward(tiny_ckpt: BuiltCheckpoint) -> None:
    tokens, steps = hf_greedy_steps(tiny_ckpt.hf_model, PROMPT, 4, eos_ids=[1])
    assert len(tokens) == 4 and steps.shape == (4, TINY_BASE["vocab_size"])
    assert tokens[0] == int(hf_logits(tiny_ckpt.hf_model, PROMPT)[-1].argmax())
    compare(hf_logits(tiny_ckpt.hf_model, PROMPT + tokens[:3])[-1], steps[3])


def test_mtp_reference_depends_on_hidden_and_tokens(tiny_ckpt: BuiltCheckpoint) -> None:
    assert tiny_ckpt.mtp_state is not None
    hidden = hf_last_hidden(tiny_ckpt.hf_model, PROMPT[:-1])
    nxt, pos = torch.tensor(PROMPT[1:]), torch.arange(len(PROMPT) - 1)
    logits = mtp_reference(tiny_ckpt.config, tiny_ckpt.mtp_state, hidden, nxt, pos)
    assert logits.shape == (len(PROMPT) - 1, TINY_BASE["vocab_size"]) and torch.isfinite(logits).all()
    other_hidden = mtp_reference(tiny_ckpt.config, tiny_ckpt.mtp_state, hidden.flip(0), nxt, pos)
    other_tokens = mtp_reference(tiny_ckpt.config, tiny_ckpt.mtp_state, hidden, nxt.flip(0), pos)
    assert (other_hidden - logits).abs().max() > 1e-2 and (other_tokens - logits).abs().max() > 1e-2
    # causal: a prefix gives the same rows
    compare(logits[:4], mtp_reference(tiny_ckpt.config, tiny_ckpt.mtp_state, hidden[:4], nxt[:4], pos[:4]))


def test_corrupting_helpers(tiny_ckpt: BuiltCheckpoint, tmp_path: Path) -> None:
    import shutil

    ckpt = tmp_path / "bad"
    shutil.copytree(tiny_ckpt.path, ckpt)
    name = "model.layers.1.self_attn.q_b_proj.weight"
    drop_tensor(ckpt, name)
    assert name not in read_index(ckpt)["weight_map"] and name not in load_tensors(ckpt)
    other = "model.layers.2.mlp.experts.3.down_proj.weight"
    reshape_tensor(ckpt, other, (5, 7))
    assert load_tensors(ckpt)[other].shape == (5, 7)
    tensors = load_tensors(ckpt)
    assert read_index(ckpt)["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in tensors.values()
    )
    assert set_config_field(ckpt, "rope_parameters.factor", 8.0)["rope_parameters"]["factor"] == 8.0
    assert "q_lora_rank" not in set_config_field(ckpt, "q_lora_rank", DELETE)
    shard = truncate_shard(ckpt, -100)
    with pytest.raises(Exception):  # noqa: B017 - safetensors raises its own error type
        load_file(shard)


def test_deepseek_style_config_and_variants(tiny_ckpt: BuiltCheckpoint, tmp_path: Path) -> None:
    import shutil

    ckpt = tmp_path / "ds"
    shutil.copytree(tiny_ckpt.path, ckpt)
    config = deepseek_style_config(ckpt)
    assert (
        "rope_parameters" not in config
        and config["rope_scaling"]["type"] == "yarn"
        and "rope_theta" in config
    )
    assert torch.equal(hf_logits(_reload(ckpt), PROMPT), hf_logits(tiny_ckpt.hf_model, PROMPT))
    # YaRN mscale variants change the model; the negative-bias variant writes negative biases
    built = build_checkpoint(
        tmp_path / "var",
        {**ROPE_VARIANTS["mscale_mixed"], "_bias_negative": True},
        with_mtp=False,
        num_shards=1,
        bias_scale=1.0,
    )
    assert built.mtp_state is None and built.config["num_nextn_predict_layers"] == 0
    assert (load_tensors(built.path)["model.layers.2.mlp.gate.e_score_correction_bias"] < 0).all()
    assert not torch.allclose(hf_logits(built.hf_model, PROMPT), hf_logits(tiny_ckpt.hf_model, PROMPT))


def test_mtp_reference_matches_transformers_mtp_layer(tiny_ckpt: BuiltCheckpoint) -> None:
    """Cross-check the formula against transformers' own generic MTP layer (MtpModel/MtpLayer)."""
    mtp_layers = pytest.importorskip("transformers.modeling_layers")
    state = tiny_ckpt.mtp_state
    assert state is not None
    prefix = f"model.layers.{TINY_BASE['num_hidden_layers']}."
    main = copy.deepcopy(tiny_ckpt.hf_model)  # MtpModel shares the main model's embedding and head
    main.model.embed_tokens.weight.data.copy_(state[prefix + "embed_tokens.weight"])
    main.lm_head.weight.data.copy_(state[prefix + "shared_head.head.weight"])
    mtp = mtp_layers.MtpModel(main, 1).eval()
    renamed = {}
    for name, tensor in to_hf_memory_layout(state, prefix).items():
        if name.startswith(("enorm.", "hnorm.", "eh_proj.")):
            renamed["layers.0." + name] = tensor
        elif name == "shared_head.norm.weight":
            renamed["layers.0.post_norm.weight"] = tensor
        elif not name.startswith(("shared_head.", "embed_tokens.")):
            renamed["layers.0.mtp_block." + name] = tensor
    missing, unexpected = mtp.load_state_dict(renamed, strict=False)
    assert not unexpected and set(missing) <= {"embed_tokens.weight", "shared_head.weight"}

    hidden = hf_last_hidden(tiny_ckpt.hf_model, PROMPT[:-1])
    nxt, pos = torch.tensor(PROMPT[1:]), torch.arange(len(PROMPT) - 1)
    mask = torch.full((len(pos), len(pos)), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        emb = mtp.embed_tokens(nxt[None])
        out = mtp.layers[0](emb, hidden[None], mtp.rotary_emb(emb, pos[None]), mask, pos[None], None)
        theirs = mtp.shared_head(out)[0]
    compare(theirs, mtp_reference(tiny_ckpt.config, state, hidden, nxt, pos))
