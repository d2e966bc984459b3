"""Tiny DeepSeek-V4 checkpoints written by transformers' ``DeepseekV4ForCausalLM``: every layer type
(sliding only, CSA with its indexer, HCA), hash-routed and routed MoE layers and mHC streams, with a
sliding window and compression rates far below the prompt lengths and ``index_topk`` below the
number of compressed entries. The indexer has 8 heads: with fewer, ReLU zeros tie at the top-k
boundary and transformers itself picks differently with and without its cache.

``with_tokenizer`` copies the built-in tiny model's tokenizer (4,096 ids) and sets the vocabulary
to it, so that the engine and the servers can run the checkpoint.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from harness.checkpoints import TOKENIZER_DIR, TOKENIZER_FILES

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
VOCAB = 320
TOKENIZER_VOCAB = 4096
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


def build_v4(name: str, directory: Path, with_tokenizer: bool = False) -> Any:
    """Write the tiny V4 checkpoint ``name`` (a key of CONFIGS) into ``directory``; returns
    transformers' model, the reference."""
    import transformers

    vocab = {"vocab_size": TOKENIZER_VOCAB, "bos_token_id": 0, "eos_token_id": 1} if with_tokenizer else {}
    config = transformers.DeepseekV4Config(**{**BASE, **CONFIGS[name], **vocab})
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
    if with_tokenizer:
        for name_ in TOKENIZER_FILES:
            if (TOKENIZER_DIR / name_).exists():
                shutil.copy(TOKENIZER_DIR / name_, directory / name_)
    return model


def greedy_reference(model: Any, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy continuation of ``prompt`` (its own cache), ``max_tokens`` tokens."""
    ids = torch.tensor([prompt])
    with torch.no_grad():  # the mask given: a BOS equal to the pad id is a token, not padding
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def add_v4_mtp(directory: Path, attention_scale: float | None = None, seed: int = 1) -> None:
    """Add an MTP layer to the V4 checkpoint in ``directory`` under the release's names (``mtp.0.*``:
    experts one by one, ``hc_attn_fn``, ``hc_head_fn``...), as transformers keeps none.

    ``attention_scale`` None: random weights (drafts almost never accepted). A number: the
    checkpoint made nearly a bigram model (every layer's FFN output zeroed, its attention output
    scaled by it; at 0 the next token depends on the current one only) whose MTP layer computes
    the bigram of the token it is given, so its drafts agree with the target except where attention
    tips the choice."""
    from safetensors.torch import load_file, save_file

    from dsinfer.base.v4_config import V4Config
    from dsinfer.model.deepseek_v4 import DeepseekV4ForCausalLM
    from dsinfer.ops import select_ops

    file = directory / "model.safetensors"
    tensors = load_file(str(file))
    config = V4Config.model_validate_json((directory / "config.json").read_text())
    model = DeepseekV4ForCausalLM(config, select_ops("cpu", quiet=True), num_mtp_layers=1)
    generator = torch.Generator().manual_seed(seed)
    inner = config.moe_intermediate_size
    mtp: dict[str, torch.Tensor] = {}
    for name, param in [*model.mtp.named_parameters(), *model.mtp.named_buffers()]:
        if name.endswith(("inv_freq", "expert_load")):  # derived, or a runtime counter
            continue
        name = "mtp." + name
        if name.endswith(("norm.weight",)):
            value = 1 + 0.1 * torch.randn(param.shape, generator=generator)
        elif name.endswith(("base", "scale", "attn_sink", "ape", "gate.bias")):
            value = 0.5 * torch.randn(param.shape, generator=generator)
        else:
            value = param.shape[-1] ** -0.5 * torch.randn(param.shape, generator=generator)
        mtp[name] = value
    if attention_scale is not None:
        hidden = config.hidden_size
        for name in tensors:
            if name.endswith(("ffn.shared_experts.w2.weight",)) or (
                ".experts." in name and name.endswith("w2.weight")
            ):
                tensors[name] = torch.zeros_like(tensors[name])
            elif name.endswith("attn.wo_b.weight"):
                tensors[name] = tensors[name] * attention_scale
        mtp["mtp.0.h_proj.weight"] = torch.zeros(hidden, hidden)
        mtp["mtp.0.e_proj.weight"] = torch.eye(hidden)
        mtp["mtp.0.enorm.weight"] = torch.ones(hidden)
        mtp["mtp.0.norm.weight"] = tensors["model.norm.weight"].clone()
        for name in ("mtp.0.attn.wo_b.weight", "mtp.0.ffn.w2", "mtp.0.ffn.shared_experts.w2.weight"):
            mtp[name] = torch.zeros_like(mtp[name])
    released = {}
    for name, value in mtp.items():
        if name.endswith(("ffn.w13", "ffn.w2")):  # stacked here, one by one in the release
            prefix = name.rsplit(".", 1)[0]
            for e in range(value.shape[0]):
                if name.endswith("w13"):
                    released[f"{prefix}.experts.{e}.w1.weight"] = value[e, :inner]
                    released[f"{prefix}.experts.{e}.w3.weight"] = value[e, inner:]
                else:
                    released[f"{prefix}.experts.{e}.w2.weight"] = value[e]
            continue
        for ours, theirs in (
            (".attn_hc.", ".hc_attn_"),
            (".ffn_hc.", ".hc_ffn_"),
            (".hc_head.", ".hc_head_"),
        ):
            name = name.replace(ours, theirs)
        released[name] = value
    tensors |= {name: value.to(tensors["head.weight"].dtype).contiguous() for name, value in released.items()}
    save_file(tensors, str(file), metadata={"format": "pt"})
