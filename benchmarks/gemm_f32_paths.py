"""One float32 linear on the CPU: ATen's GEMM (MKL) against oneDNN's packed weight, by shape and rows.

For each weight shape of the tiny preset (and its head) and each row count, times ``F.linear`` and
``torch.ops.mkldnn._linear_pointwise`` on the weight reordered once (what
``ops.pack_linear_weight`` keeps for float32 weights of ``PACKED_F32_MIN_ELEMENTS`` or more), median
of ``--repeats`` rounds of ``--calls`` calls, the two alternating. Also checks whether a row's
output bits depend on how many rows share the call, for each path. Records the CPU model and ISA.

    .venv/bin/python benchmarks/gemm_f32_paths.py --out benchmarks/results/gemm_f32_paths_epyc.json \
        --markdown benchmarks/results/gemm_f32_paths_epyc.md
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from harness.plots import plot_result
from harness.provenance import load_average, run_machine
from harness.results import add_output_args, machine_lines, save_report

SHAPES = ((704, 256), (576, 256), (4096, 256), (1024, 256), (256, 512), (384, 128), (256, 256), (256, 128))
ROWS = (1, 16, 64, 256)


def _time(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn(x)
    return (time.perf_counter() - start) / calls * 1e6


def _rows_change_bits(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> list[int]:
    full = fn(x)
    return [m for m in (1, 2, 3, 5, 8, 16, 17, 64) if not torch.equal(fn(x[:m]), full[:m])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=200)
    add_output_args(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    machine = run_machine(torch_threads=args.threads)
    gen = torch.Generator().manual_seed(0)
    rows_out = []
    for n, k in SHAPES:
        w = torch.randn(n, k, generator=gen)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)

        def onednn(a: torch.Tensor, packed: torch.Tensor = packed) -> torch.Tensor:
            return torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], "")

        def mkl(a: torch.Tensor, w: torch.Tensor = w) -> torch.Tensor:
            return F.linear(a, w)

        probe = torch.randn(300, k, generator=gen)
        varies = {"mkl": _rows_change_bits(mkl, probe), "onednn": _rows_change_bits(onednn, probe)}
        for m in ROWS:
            x = torch.randn(m, k, generator=gen)
            times: dict[str, list[float]] = {"mkl": [], "onednn": []}
            for fn in (mkl, onednn):
                _time(fn, x, 20)  # warm-up
            for _ in range(args.repeats):
                for name, fn in (("mkl", mkl), ("onednn", onednn)):
                    times[name].append(_time(fn, x, args.calls))
            med = {name: statistics.median(v) for name, v in times.items()}
            rows_out.append(
                {"n": n, "k": k, "rows": m, "us": med, "onednn_over_mkl": med["onednn"] / med["mkl"]}
            )
            print(f"{n}x{k} rows {m}: MKL {med['mkl']:.1f} us, oneDNN {med['onednn']:.1f} us", flush=True)
        rows_out.append({"n": n, "k": k, "row_counts_that_change_a_rows_bits": varies})
    machine["load_after"] = load_average()
    doc = {"machine": machine, "rows": rows_out}
    lines = [
        "# float32 linear: MKL (`F.linear`) against oneDNN's packed weight",
        "",
        *machine_lines(machine),
        f"- torch {torch.__version__}; median of {args.repeats} rounds of {args.calls} calls, the two alternating",
        "",
        "| weight (out x in) | rows | MKL us | oneDNN us | oneDNN / MKL |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows_out:
        if "us" in r:
            lines.append(
                f"| {r['n']} x {r['k']} | {r['rows']} | {r['us']['mkl']:.1f} | {r['us']['onednn']:.1f} "
                f"| {r['onednn_over_mkl']:.2f} |"
            )
    lines += [
        "",
        "Row counts at which a row's output bits differ from the same row in a call of 300 rows:",
        "",
    ]
    for r in rows_out:
        if "row_counts_that_change_a_rows_bits" in r:
            v = r["row_counts_that_change_a_rows_bits"]
            lines.append(f"- {r['n']} x {r['k']}: MKL {v['mkl'] or 'none'}, oneDNN {v['onednn'] or 'none'}")
    save_report(doc, "\n".join(lines) + "\n", args.out, args.markdown)
    plot_result(args.out)


if __name__ == "__main__":
    main()
