"""KV cache one request holds: DeepSeek-V4 (Flash, Pro) against V3, by context length.

    python benchmarks/v4_kv.py --out benchmarks/results/v4_kv.json --markdown benchmarks/results/v4_kv.md

V3 keeps MLA's latent for every token of every layer (``kv_lora_rank + qk_rope_head_dim`` values).
V4 keeps per layer a window of raw K=V rows (fixed), one compressed entry per 4 (CSA) or 128 (HCA)
tokens, CSA's indexer keys, and the compressors' unfinished rows (dsinfer/model/v4_state.py
``cache_bytes``, which the tests check against the model's own cache). Values in bf16 (2 bytes),
as dsinfer's reference keeps them; the peers store V4's entries in FP8 (about half).
"""

from __future__ import annotations

import argparse
from typing import Any

from dsinfer.base.config import ModelConfig
from dsinfer.base.presets import resolve_model
from dsinfer.base.v4_config import V4Config
from dsinfer.model.v4_state import cache_bytes
from harness.plots import plot_result
from harness.provenance import provenance
from harness.results import add_output_args, report_header, save_report, table

CONTEXTS = (1024, 8192, 32768, 131072, 1048576)
VALUE_BYTES = 2
# Released configurations (DeepSeek-V4, 2026-04-24; shared/reference/deepseek-v4.md)
_COMMON = dict(
    vocab_size=129280, num_key_value_heads=1, head_dim=512, qk_rope_head_dim=64, o_lora_rank=1024,
    sliding_window=128, index_n_heads=64, index_head_dim=128, index_topk=512, hc_mult=4,
    num_experts_per_tok=6, scoring_func="sqrtsoftplus", swiglu_limit=10.0, num_hash_layers=3,
    rope_theta=10000.0, compress_rope_theta=160000.0,
    rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536},
)  # fmt: skip
V4_MODELS = {
    "DeepSeek-V4-Flash": dict(
        _COMMON, hidden_size=4096, num_hidden_layers=43, num_attention_heads=64, q_lora_rank=1024, o_groups=8,
        n_routed_experts=256, moe_intermediate_size=2048, routed_scaling_factor=1.5,
        compress_ratios=[0, 0] + [4 if i % 2 == 0 else 128 for i in range(41)],
    ),
    "DeepSeek-V4-Pro": dict(
        _COMMON, hidden_size=7168, num_hidden_layers=61, num_attention_heads=128, q_lora_rank=1536, o_groups=16,
        n_routed_experts=384, moe_intermediate_size=3072, routed_scaling_factor=2.5,
        compress_ratios=[128, 128] + [4 if i % 2 else 128 for i in range(59)],
    ),
}  # fmt: skip


def v3_bytes(context: int) -> int:
    config = ModelConfig.from_file(resolve_model("deepseek-v3")[0] / "config.json")
    return config.num_hidden_layers * config.kv_cache_dim * VALUE_BYTES * context


def measure() -> dict[str, Any]:
    rows = []
    for context in CONTEXTS:
        row: dict[str, Any] = {"context": context, "DeepSeek-V3": {"total": v3_bytes(context)}}
        for name, fields in V4_MODELS.items():
            groups = cache_bytes(V4Config.model_validate(fields), context, VALUE_BYTES)
            row[name] = {**groups, "total": sum(groups.values())}
        rows.append(row)
    return {"contexts": rows}


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def markdown(report: dict[str, Any]) -> list[str]:
    lines = ["# KV cache per request: DeepSeek-V4 against V3", "", *report_header(report), ""]
    lines += ["MiB one request holds (bf16 values):", ""]
    names = ["DeepSeek-V3", *V4_MODELS]
    rows = [
        (f"{r['context']:,}", *(_mib(r[n]["total"]) for n in names), f"{r['DeepSeek-V3']['total'] / r['DeepSeek-V4-Flash']['total']:.1f}x")
        for r in report["results"]["contexts"]
    ]  # fmt: skip
    lines += table(["context", *names, "V3 / V4-Flash"], rows, "r" * (len(names) + 2))
    lines += ["", "V4 by cache group (MiB): window, compressed entries, indexer keys, compressor state:", ""]
    groups = ("window", "compressed", "indexer", "compressor_state")
    rows = [
        (f"{r['context']:,}", name, *(_mib(r[name][g]) for g in groups))
        for r in report["results"]["contexts"]
        for name in V4_MODELS
    ]
    lines += table(["context", "model", *groups], rows, "rlrrrr")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_output_args(parser)
    args = parser.parse_args()
    report = {**provenance(), "value_bytes": VALUE_BYTES, "results": measure()}
    save_report(report, "\n".join(markdown(report)) + "\n", args.out, args.markdown)
    plot_result(args.out)


if __name__ == "__main__":
    main()
