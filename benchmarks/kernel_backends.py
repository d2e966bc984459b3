"""Offline tokens/s with the kernel backends chosen here against a baseline choice, two engines
in one process, in paired passes.

Two ``LLM`` engines on the offline benchmark's checkpoint (4 layers, hidden 256, 16 experts of
which 4 active), one with ``kernel_backends="auto"`` (what ``dsinfer serve`` picks on this
machine) and one with ``--baseline`` (default ``numba``: the float32-math CPU kernels, where auto
runs the bf16 routed experts on AMX tiles). Workload per batch B: B prompts of 32 random token
ids, 128 output tokens, greedy, ``ignore_eos``.

Per batch, ``--pairs`` pairs of passes, the engines alternating which runs first, in each of
``--rounds`` rounds of fresh engines, each engine built first in turn (of two identical engines,
the one built first ran 4-8% slower). Reported: each engine's median output tok/s and the median
(and range) of the pairs' ratios, which keeps the shared machine's drift (10-30% from minute to
minute) out of the comparison. The outputs are compared token for token: kernels that round
differently (AMX rounds the SwiGLU to bf16) may part on a near tie.

    python benchmarks/kernel_backends.py --out benchmarks/results/kernel_backends_amx.json \\
        --markdown benchmarks/results/kernel_backends_amx.md
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from dsinfer import LLM, SamplingParams
from harness.provenance import load_average, run_machine
from harness.results import add_output_args, machine_lines, save_report, table

REPO = Path(__file__).resolve().parent.parent
COLUMNS = ("batch", "auto tok/s", "baseline tok/s", "auto / baseline", "range", "same tokens")


def _pass(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return sum(map(len, tokens)) / wall, tokens


def _engines(args: argparse.Namespace, first: str) -> dict[str, LLM]:
    backends = {"auto": "auto", "baseline": args.baseline}
    order = (first, *(n for n in backends if n != first))
    return {
        name: LLM(
            str(args.model), dtype=args.dtype, kernel_backends=backends[name], enable_prefix_caching=False
        )
        for name in order
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    if not (args.model / "config.json").exists():
        make = REPO / "benchmarks" / "make_bench_checkpoint.py"
        subprocess.run([sys.executable, str(make), "--out", str(args.model)], check=True)
    rng = random.Random(0)
    batches = [int(b) for b in args.batches.split(",")]
    prompts = [[rng.randrange(2, 4096) for _ in range(32)] for _ in range(max(batches))]
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    tok_s = {b: {"auto": [], "baseline": []} for b in batches}
    same: dict[int, int] = {}
    chosen: dict[str, dict[str, str]] = {}
    for round_ in range(args.rounds):
        # fresh engines each round, built in turn first: the engine built first ran 4-8% slower
        # than an identical one built after it (auto against auto)
        engines = _engines(args, "auto" if round_ % 2 == 0 else "baseline")
        chosen = {name: dict(llm.engine.ops.backends) for name, llm in engines.items()}
        for llm in engines.values():  # compile and warm every path
            llm.generate(prompts, params, use_tqdm=False)
        for batch in batches:
            tokens: dict[str, list[list[int]]] = {}
            for pair in range(args.pairs):
                for name in ("auto", "baseline") if pair % 2 == 0 else ("baseline", "auto"):
                    rate, tokens[name] = _pass(engines[name], prompts[:batch], params)
                    tok_s[batch][name].append(rate)
                print(
                    f"round {round_} batch {batch} pair {pair}: auto {tok_s[batch]['auto'][-1]:,.0f} "
                    f"baseline {tok_s[batch]['baseline'][-1]:,.0f}",
                    flush=True,
                )
            same[batch] = sum(a == b for a, b in zip(tokens["auto"], tokens["baseline"], strict=True))
        for llm in engines.values():
            llm.engine.close()
    rows = []
    for batch in batches:
        ratios = [a / b for a, b in zip(tok_s[batch]["auto"], tok_s[batch]["baseline"], strict=True)]
        rows.append(
            {
                "batch": batch,
                "tok_s": tok_s[batch],
                "median_tok_s": {name: statistics.median(v) for name, v in tok_s[batch].items()},
                "ratios": ratios,
                "median_ratio": statistics.median(ratios),
                "same_outputs": same[batch],
            }
        )
    return {"backends": chosen, "rows": rows}


def markdown(result: dict[str, Any]) -> str:
    rows = [
        (r["batch"], f"{r['median_tok_s']['auto']:,.0f}", f"{r['median_tok_s']['baseline']:,.0f}",
         f"**{r['median_ratio']:.2f}x**", f"{min(r['ratios']):.2f}-{max(r['ratios']):.2f}",
         f"{r['same_outputs']} of {r['batch']}")
        for r in result["rows"]
    ]  # fmt: skip
    differ = {k: v for k, v in result["backends"]["auto"].items() if result["backends"]["baseline"][k] != v}
    return "\n".join(
        [
            "# Kernel backends: auto against a baseline (offline, one process, paired passes)",
            "",
            *machine_lines(result["machine"]),
            f"- checkpoint {result['model']}, {result['dtype']}; {result['pairs']} pairs of passes per batch in "
            f"each of {result['rounds']} rounds of fresh engines (each engine built first in turn)",
            "- backends that differ: "
            + ", ".join(f"{k} {v} (baseline {result['backends']['baseline'][k]})" for k, v in differ.items()),
            "",
            "Output tokens per second (medians of the passes); auto / baseline: the median of the pairs' "
            "ratios (their range beside it); same tokens: requests of the last pair whose outputs match:",
            "",
            *table(COLUMNS, rows, "r" * len(COLUMNS)),
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=Path("/work/bench-scratch/ckpt/tiny-f32"))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--baseline", default="numba", help="the other engine's --kernel-backends")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--pairs", type=int, default=5, help="pairs of passes per batch and round")
    parser.add_argument(
        "--rounds", type=int, default=2, help="rounds of fresh engines, each built first in turn"
    )
    add_output_args(parser)
    args = parser.parse_args()
    machine = run_machine()
    result: dict[str, Any] = {
        "machine": machine,
        "model": str(args.model),
        "dtype": args.dtype,
        "pairs": args.pairs,
        "rounds": args.rounds,
        **run(args),
    }
    machine["load_after"] = load_average()
    save_report(result, markdown(result), args.out, args.markdown)


if __name__ == "__main__":
    main()
