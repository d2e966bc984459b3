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
