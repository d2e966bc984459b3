"""The CPU absorbed MLA decode kernel with a sequence's query rows in one task or spread over the
threads (``dsinfer.ops.mla_cpu.row_groups``), paired in one process.

For each shape, ``--repeats`` rounds; each round times ``--calls`` calls with every sequence's
rows in one task (``groups=1``, the kernel before the split) and as many with the default, the
order alternating between rounds. Reported: the median call of each, their ratio, and whether the
outputs are bit for bit equal (they must be: the split keeps whole blocks of four rows). Shapes: DeepSeek-V3's 128 heads at batch 1 (float32 and bf16), 16 heads verifying a draft,
tiny-chat's 4 heads verifying two drafts at batch 1, and batch 64 (where the sequences alone fill
the threads and nothing changes).

    .venv/bin/python benchmarks/mla_cpu_rows.py --out benchmarks/results/mla_cpu_rows.json \\
        --markdown benchmarks/results/mla_cpu_rows.md
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from dsinfer.ops import mla_cpu
from harness.plots import plot_result
from harness.provenance import load_average, run_machine
from harness.results import add_output_args, machine_lines, save_report, table

LATENT, ROPE, PAGE = 512, 64, 64
# name, heads, nope = v head dim, context, batch, query tokens per sequence, dtype
SHAPES: list[tuple[str, int, int, int, int, int, torch.dtype]] = [
    ("V3 heads, b1, 1K", 128, 128, 1024, 1, 1, torch.float32),
    ("V3 heads, b1, 1K, bf16", 128, 128, 1024, 1, 1, torch.bfloat16),
    ("16 heads, b1, 2K, verify", 16, 128, 2048, 1, 2, torch.float32),
    ("tiny-chat, b1, two drafts", 4, 32, 60, 1, 3, torch.float32),
    ("tiny-chat, b64, bf16", 4, 32, 60, 64, 1, torch.bfloat16),
]
HEADERS = ("shape", "one task per sequence (us)", "rows split (us)", "speed-up", "same bits")


def _inputs(heads: int, head_dim: int, context: int, batch: int, s_q: int, dtype: torch.dtype) -> list[Any]:
    gen = torch.Generator().manual_seed(heads + context + batch)
    pages = -(-context // PAGE) * batch
    cache = torch.randn(pages, PAGE, 1, LATENT + ROPE, generator=gen).to(dtype)
    w_uk = torch.randn(heads, head_dim, LATENT, generator=gen).to(dtype)
    w_uv_t = torch.randn(heads, head_dim, LATENT, generator=gen).to(dtype).transpose(1, 2)  # as MLA keeps it
    q_nope = torch.randn(batch, s_q, heads, head_dim, generator=gen)
    q_pe = torch.randn(batch, s_q, heads, ROPE, generator=gen)
    table_ = torch.arange(pages, dtype=torch.int32).view(batch, -1)
    lens = torch.full((batch,), context, dtype=torch.int32)
    return [q_nope, q_pe, w_uk, w_uv_t, cache, table_, lens, 0.1, True]


def _median_call(call: Callable[[], torch.Tensor], calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def run(args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    for name, heads, head_dim, context, batch, s_q, dtype in SHAPES:
        inputs = _inputs(heads, head_dim, context, batch, s_q, dtype)
        calls = {  # None: the default split of the thread budget
            "one": functools.partial(mla_cpu.mla_decode_absorbed_in_groups, *inputs, 1),
            "split": functools.partial(mla_cpu.mla_decode_absorbed_in_groups, *inputs, None),
        }
        times: dict[str, list[float]] = {"one": [], "split": []}
        outputs = {}
        for rnd in range(args.repeats):
            for mode in ("one", "split") if rnd % 2 == 0 else ("split", "one"):
                outputs[mode] = calls[mode]()  # also the warm-up of the round
                times[mode].append(_median_call(calls[mode], args.calls))
        one, split = statistics.median(times["one"]), statistics.median(times["split"])
        rows.append(
            {
                "shape": name,
                "one_task_us": one,
                "split_us": split,
                "speedup": one / split,
                "same_bits": torch.equal(outputs["one"], outputs["split"]),
                "rounds": times,
            }
        )
        print(f"{name}: {one:,.0f} -> {split:,.0f} us", flush=True)
    return {"rows": rows, "threads": torch.get_num_threads()}


def markdown(result: dict[str, Any]) -> str:
    body = [
        (r["shape"], f"{r['one_task_us']:,.0f}", f"{r['split_us']:,.0f}", f"{r['speedup']:.2f}x",
         "yes" if r["same_bits"] else "NO")
        for r in result["rows"]
    ]  # fmt: skip
    return "\n".join(
        [
            "# CPU absorbed MLA decode: a sequence's rows in one task or split over the threads",
            "",
            *machine_lines(result["machine"]),
            f"- {result['threads']} threads; medians over {result['repeats']} alternating rounds of "
            f"{result['calls']} calls; pages of {PAGE} tokens, latent {LATENT} + {ROPE}",
            "",
            *table(HEADERS, body, "lrrrl"),
            "",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=9)
    add_output_args(parser)
    args = parser.parse_args()
    machine = run_machine(torch.get_num_threads())
    result = {"machine": machine, "repeats": args.repeats, "calls": args.calls, **run(args)}
    machine["load_after"] = load_average()
    save_report(result, markdown(result), args.out, args.markdown)
    plot_result(args.out)


if __name__ == "__main__":
    main()
