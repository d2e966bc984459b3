"""Decode step time of DeepSeek-V4 (compressed sparse attention over a hybrid cache) against V3
(dense MLA) at 1K to 32K tokens of context, with the KV cache one request holds.

Both models keep their real attention shapes, cut to 2 decoder layers with small MoE blocks and a
small vocabulary (those cost the same at every context), random weights, float32 on this
machine's CPU through the ops ``select_ops("cpu")`` picks:

- V3: 128 heads, a 512 + 64 latent, q LoRA 512, dense MLPs (benchmarks/v32_decode.py's shapes);
  every step reads every cached latent through the absorbed paged path.
- V4-Flash: 64 query heads on one K=V head of 512, q LoRA 1,024, grouped output (8 x 1,024), a
  128-token window, one CSA layer (entries per 4 tokens, an indexer of 64 x 128 picking 512) and
  one HCA layer (per 128 tokens), 4 mHC streams.

For each context C and batch B: B sequences whose caches hold C tokens (harness/decode_steps.py:
random values of the right shapes) take one-token decode steps; reported: the median and min of
``--repeats`` timed steps after ``--warmup``, and the bytes one request's cache holds in these
2-layer float32 models (V3: C x 576 values per layer; V4: what its state holds, by group).

V4 with its MTP layer (a window-only layer, random weights): a verification step (the last token
and a draft per sequence, undo records kept, the draft taken back as rejected: the most a
verification costs) and the MTP layer's draft (one position per sequence, its logits), against the
plain step; the speed-up MTP would give at full acceptance is 2 x plain / (verify + draft).

    .venv/bin/python benchmarks/v4_decode.py \\
        --out benchmarks/results/v4_decode.json --markdown benchmarks/results/v4_decode.md
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from dsinfer.base.v4_config import CSA, HCA, V4Config
from dsinfer.model.deepseek_v4 import DeepseekV4ForCausalLM
from dsinfer.model.loader import load_model
from dsinfer.ops import select_ops
from harness import decode_steps as steps
from harness.results import table

V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 4096,
    "hidden_size": 1024, "intermediate_size": 1024, "moe_intermediate_size": 256,
    "num_hidden_layers": 2, "first_k_dense_replace": 2, "num_attention_heads": 128, "q_lora_rank": 512,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 65536,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 4096,
                     "mscale": 1.0, "mscale_all_dim": 1.0},
}  # fmt: skip
V4 = {
    "model_type": "deepseek_v4", "vocab_size": 4096, "hidden_size": 1024, "moe_intermediate_size": 256,
    "num_hidden_layers": 2, "num_attention_heads": 64, "head_dim": 512, "qk_rope_head_dim": 64,
    "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024, "layer_types": [CSA, HCA],
    "mlp_layer_types": ["moe", "moe"], "sliding_window": 128, "index_n_heads": 64, "index_head_dim": 128,
    "index_topk": 512, "hc_mult": 4, "n_routed_experts": 8, "num_experts_per_tok": 2, "swiglu_limit": 10.0,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536},
}  # fmt: skip
V3_LATENT = 512 + 64


def _v3(scratch: Path) -> tuple[Any, Any]:
    (scratch / "config.json").write_text(json.dumps(V3))
    loaded = load_model(scratch, select_ops("cpu"), dtype=torch.float32, load_format="dummy")
    return loaded.model, loaded.config


def _v4() -> DeepseekV4ForCausalLM:
    model = DeepseekV4ForCausalLM(V4Config.model_validate(V4), select_ops("cpu"), num_mtp_layers=1).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
    return model


def _mtp_row(r: dict[str, Any]) -> tuple[Any, ...]:
    plain, verify, draft = r["v4_ms"], r["verify_ms"], r["draft_ms"]
    speedup = 2 * plain / (verify + draft)
    ctx = f"{r['context']:,}"
    return (
        r["batch"],
        ctx,
        f"{plain:.1f}",
        f"{verify:.1f}",
        f"{verify / plain:.2f}",
        f"{draft:.1f}",
        f"{speedup:.2f}x",
    )


def _markdown(result: dict[str, Any]) -> str:
    memory = [
        (f"{r['context']:,}", f"{r['v3_bytes'] / 2**20:.2f}", f"{r['v4_bytes'] / 2**20:.2f}",
         f"{r['v3_bytes'] / r['context']:,.0f}", f"{r['v4_bytes'] / r['context']:,.0f}",
         ", ".join(f"{k} {v / 2**20:.2f}" for k, v in r["v4_groups"].items()))
        for r in result["steps"] if r["batch"] == result["steps"][0]["batch"]
    ]  # fmt: skip
    return steps.step_report(
        "DeepSeek-V4 against V3: decode step time and KV cache per request at long contexts",
        result["machine"],
        [
            steps.step_times_section(
                result["steps"],
                "each model's",
                {"v3": "V3 (MLA)", "v4": "V4 (CSA + HCA)"},
                ("v3", "v4", "V3 / V4"),
            ),
            (
                "KV cache one request holds in these 2-layer float32 models (MiB), bytes per token of "
                "context, and V4's by group (MiB):",
                table(("context", "V3", "V4", "V3 B/token", "V4 B/token", "V4 groups"), memory, "rrrrrl"),
            ),
            (
                "V4 with MTP, ms (median): the plain step, a verification (two tokens per sequence, "
                "the draft taken back), the MTP layer's draft, and the speed-up at full acceptance "
                "(2 x plain / (verify + draft)):",
                table(
                    ("batch", "context", "plain", "verify", "verify / plain", "draft", "speed-up"),
                    [_mtp_row(r) for r in result["steps"]],
                    "rrrrrrr",
                ),
            ),
            ("The real 61-layer V3 and 43/61-layer V4 models' figures (bf16): [v4_kv.md](v4_kv.md).", []),
        ],
    )


def main() -> None:
    args = steps.parse_step_args(__doc__, contexts="1024,8192,32768")
    machine = steps.step_machine()
    with tempfile.TemporaryDirectory() as scratch:
        v3, v3_config = _v3(Path(scratch))
        v4 = _v4()

        def measure(batch: int, context: int) -> dict[str, Any]:
            dense = steps.v3_step_times(v3, v3_config, context, batch, args.warmup, args.repeats)
            compressed, groups = steps.v4_step_times(v4, context, batch, args.warmup, args.repeats)
            verify, draft = steps.v4_mtp_step_times(v4, context, batch, args.warmup, args.repeats)
            return {
                **steps.timing_fields("v3", dense),
                **steps.timing_fields("v4", compressed),
                **steps.timing_fields("verify", verify),
                **steps.timing_fields("draft", draft),
                "v3_bytes": context * V3_LATENT * 4 * V3["num_hidden_layers"],
                "v4_bytes": sum(groups.values()),
                "v4_groups": groups,
            }

        rows = steps.sweep(args, measure)
    fields = {
        "title": "Decode step: DeepSeek-V4 (CSA + HCA) against V3 (MLA), 2 layers, CPU",
        "series": [["v3_ms", "V3 (MLA)"], ["v4_ms", "V4 (CSA + HCA)"]],
        "steps": rows,
    }
    steps.save_step_run(args, machine, fields, _markdown)


if __name__ == "__main__":
    main()
