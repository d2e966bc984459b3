"""Decode throughput at batch 64 with a ``json_schema`` constraint against none (offline engine).

The same 64 seeded random prompts (``--input-len`` tokens each) are decoded greedily for
``--output-len`` tokens, once unconstrained (``ignore_eos``) and once under the grammar of
``SCHEMA`` (llguidance; the worker's batched token bitmask, dsinfer/engine/constraints.py). The
schema asks for an array of at least 500 objects (a bounded integer, a short string, an enum), so
no output can complete the JSON within the run: both runs decode exactly the same number of
tokens. Per run: a prefill-only pass (max_tokens 1), then the full pass; decode tok/s =
64 x (output_len - 1) / (full - prefill). Runs alternate (none, json, none, json...) ``--repeats``
times; medians are reported with the cost of the constraint, target <= 10%.

    python benchmarks/structured_decode.py --out benchmarks/results/structured_decode.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from dsinfer import LLM, SamplingParams
from dsinfer.base import grammar

SCHEMA = {
    "type": "array",
    "minItems": 500,
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 100000},
            "name": {"type": "string", "maxLength": 12},
            "kind": {"enum": ["alpha", "beta", "gamma"]},
        },
        "required": ["id", "name", "kind"],
        "additionalProperties": False,
    },
}


def timed(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default="tiny", help="checkpoint directory or preset (dummy weights if a preset)"
    )
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/structured_decode.md"))
    args = parser.parse_args()
    preset = not Path(args.model).is_dir()
    llm = LLM(
        args.model,
        load_format="dummy" if preset else "auto",
        dtype="float32",
        kv_cache_memory="256MiB",
        max_num_seqs=args.batch,
        max_num_batched_tokens=max(2048, args.batch * args.input_len),
    )
    gen = torch.Generator().manual_seed(0)
    high = min(llm.engine.tokenizer.vocab_size, 4000)  # below the tiny vocabulary's added tokens
    prompts = [torch.randint(100, high, (args.input_len,), generator=gen).tolist() for _ in range(args.batch)]
    schema_grammar = grammar.json_schema(SCHEMA)
    kinds = {
        "none": {"ignore_eos": True},
        "json_schema": {"grammar": schema_grammar},
    }
    load = os.getloadavg()
    timed(
        llm, prompts, SamplingParams(temperature=0, max_tokens=8, grammar=schema_grammar)
    )  # warm-up, compile
    decode: dict[str, list[float]] = {k: [] for k in kinds}
    for repeat in range(args.repeats):
        for kind, extra in kinds.items():
            prefill_s, _ = timed(llm, prompts, SamplingParams(temperature=0, max_tokens=1, **extra))
            full_s, outs = timed(
                llm, prompts, SamplingParams(temperature=0, max_tokens=args.output_len, **extra)
            )
            assert all(len(o) == args.output_len for o in outs), f"{kind}: an output ended early"
            if kind == "json_schema" and repeat == 0:
                text = llm.engine.tokenizer.decode(outs[0])
                assert text.startswith("[{"), text[:80]
            rate = args.batch * (args.output_len - 1) / (full_s - prefill_s)
            decode[kind].append(rate)
            print(
                f"repeat {repeat} {kind}: decode {rate:.0f} tok/s (prefill {prefill_s:.2f} s, full {full_s:.2f} s)"
            )
    medians = {k: statistics.median(v) for k, v in decode.items()}
    cost = 1 - medians["json_schema"] / medians["none"]
    end_load = os.getloadavg()
    lines = [
        f"# Decode throughput at batch {args.batch}: json_schema against none",
        "",
        "| constraint | decode tok/s (median) | runs |",
        "| --- | ---: | --- |",
        *(f"| {k} | {medians[k]:.0f} | {', '.join(f'{r:.0f}' for r in decode[k])} |" for k in kinds),
        "",
        f"- cost of the constraint: {cost:.1%} (target <= 10%): {'met' if cost <= 0.10 else 'NOT met'}",
        f"- workload: {args.batch} prompts x {args.input_len} random tokens, greedy, {args.output_len} output "
        f"tokens each, model {args.model}{' (dummy weights)' if preset else ''}, float32, offline LLM",
        f"- schema: `{json.dumps(SCHEMA)}`",
        f"- command: python benchmarks/structured_decode.py --batch {args.batch} --input-len {args.input_len} "
        f"--output-len {args.output_len} --repeats {args.repeats}",
        f"- machine: {platform.node()}, {os.cpu_count()} cores, torch {torch.__version__}; load average "
        f"{load[0]:.1f} at start, {end_load[0]:.1f} at end",
        f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
        "",
    ]
    args.out.write_text("\n".join(lines), encoding="utf-8")
    print("\n".join(lines))
    llm.engine.close()


if __name__ == "__main__":
    main()
