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
import json
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
# the released configurations, as the presets (configs/models/deepseek-v4-*/config.json)
V4_MODELS = {"DeepSeek-V4-Flash": "deepseek-v4-flash", "DeepSeek-V4-Pro": "deepseek-v4-pro"}


def v4_config(preset: str) -> V4Config:
    return V4Config.model_validate(json.loads((resolve_model(preset)[0] / "config.json").read_text()))


def v3_bytes(context: int) -> int:
    config = ModelConfig.from_file(resolve_model("deepseek-v3")[0] / "config.json")
    return config.num_hidden_layers * config.kv_cache_dim * VALUE_BYTES * context


def measure() -> dict[str, Any]:
    rows = []
    for context in CONTEXTS:
        row: dict[str, Any] = {"context": context, "DeepSeek-V3": {"total": v3_bytes(context)}}
        for name, preset in V4_MODELS.items():
            groups = cache_bytes(v4_config(preset), context, VALUE_BYTES)
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
