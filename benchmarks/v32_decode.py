"""Decode step time of DeepSeek-V3.2 (sparse attention) against V3 (dense MLA) at long contexts,
and the KV bytes per token of both.

Two models with DeepSeek-V3's attention shapes (128 heads, 512 latent + 64 rope, q LoRA) and V3.2's
indexer (64 heads x 128, top-2048), each cut to 2 decoder layers with small dense MLPs and a small
vocabulary (their cost is the same for both models and does not grow with context), dummy weights,
float32 on this machine's CPU through the ops ``select_ops("cpu")`` picks. For each context C
(1K, 4K, 16K tokens) and batch B, B sequences of C cached tokens (random latents and indexer keys
written straight into the pool: the decode step's time does not depend on their values) take
decode steps of one token each through the absorbed path: V3's dense paged MLA decode over all C
keys, V3.2's indexer over all C keys then sparse MLA over 2048. Reported: the median and min of
``--repeats`` timed steps after ``--warmup``, per model, context and batch, and the ratio.

KV bytes per token are those of the real 61-layer models' cache specs (dsinfer/base/kv_spec.py):
bf16 latent, V3.2's indexer keys in FP8 (the GPU default: 128 e4m3 + one fp32 scale) or bf16.

    /work/venv/bin/python benchmarks/v32_decode.py \\
        --out benchmarks/results/v32_decode.json --markdown benchmarks/results/v32_decode.md
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from dsinfer.base.config import ModelConfig
from dsinfer.base.kv_spec import KVCacheSpec
from dsinfer.base.presets import resolve_model
from dsinfer.model.loader import load_model
from dsinfer.ops import select_ops
from harness import decode_steps as steps
from harness.results import table

ATTENTION = {  # DeepSeek-V3 / V3.2 attention, 2 dense layers, small MLP and vocabulary
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 4096,
    "hidden_size": 1024,
    "intermediate_size": 1024,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 2,
    "first_k_dense_replace": 2,
    "num_attention_heads": 128,
    "q_lora_rank": 512,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 32768,
    "rope_scaling": {"type": "yarn", "factor": 8, "original_max_position_embeddings": 4096,
                     "mscale": 1.0, "mscale_all_dim": 1.0},
}  # fmt: skip
SPARSE = {
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
    "index_topk": 2048,
    "index_n_heads": 64,
    "index_head_dim": 128,
}


def _model(config: dict[str, Any], scratch: Path) -> tuple[Any, ModelConfig]:
    path = scratch / config["model_type"]
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    loaded = load_model(path, select_ops("cpu"), dtype=torch.float32, load_format="dummy")
    return loaded.model, loaded.config


def kv_bytes_per_token() -> list[dict[str, Any]]:
    rows = []
    for name, indexer in (("deepseek-v3", "model"), ("deepseek-v3.2", "fp8"), ("deepseek-v3.2", "model")):
        config = ModelConfig.from_file(resolve_model(name)[0] / "config.json")
        spec = KVCacheSpec.for_model(config, "bfloat16", indexer)  # type: ignore[arg-type]
        layers = config.num_hidden_layers
        rows.append(
            {
                "model": name,
                "cache": spec.describe(),
                "bytes_per_token_per_layer": spec.bytes_per_token,
                "layers": layers,
                "bytes_per_token": spec.bytes_per_token * layers,
            }
        )
    return rows


def _markdown(result: dict[str, Any]) -> str:
    kv = [
        (r["model"], f"{r['cache']}: {r['bytes_per_token_per_layer']} B", f"{r['bytes_per_token']:,}")
        for r in result["kv_bytes"]
    ]
    return steps.step_report(
        "V3.2 (sparse attention) vs V3 (dense MLA): decode step time and KV bytes per token",
        result["machine"],
        [
            steps.step_times_section(
                result["steps"], "V3's", {"v3": "V3 dense", "v32": "V3.2 sparse"}, ("v32", "v3", "V3.2 / V3")
            ),
            (
                "KV cache per token (61 layers, bf16 latent):",
                table(("model", "per layer", "bytes per token"), kv, "llr"),
            ),
        ],
    )


def main() -> None:
    args = steps.parse_step_args(__doc__, contexts="1024,4096,16384")
    machine = steps.step_machine()
    with tempfile.TemporaryDirectory() as scratch:
        v3, v3_config = _model(ATTENTION, Path(scratch))
        v32, v32_config = _model({**ATTENTION, **SPARSE}, Path(scratch))

        def measure(batch: int, context: int) -> dict[str, Any]:
            dense = steps.v3_step_times(v3, v3_config, context, batch, args.warmup, args.repeats)
            sparse = steps.v3_step_times(v32, v32_config, context, batch, args.warmup, args.repeats)
            return {**steps.timing_fields("v3", dense), **steps.timing_fields("v32", sparse)}

        rows = steps.sweep(args, measure)
    steps.save_step_run(args, machine, {"steps": rows, "kv_bytes": kv_bytes_per_token()}, _markdown)


if __name__ == "__main__":
    main()
