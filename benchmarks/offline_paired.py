"""dsinfer against vLLM's CPU build, offline, in pairs of passes with both engines up.

offline_throughput.py runs each engine once in a subprocess of its own, one after the other. On a
shared machine whose speed swings by 15% from one minute to the next, one pass each cannot tell a
10% difference. Here both engines' workers (offline_throughput.py's, pinned with `taskset` to the
same cores, vLLM from its own virtualenv) load the checkpoint, run their warm-up, prefill-only and
timed passes, and then stay up: the driver asks each in turn for one more timed pass (the same
workload: N prompts of random token ids, greedy, a fixed number of output tokens with ignore_eos),
alternating which engine goes first, so that each pair of passes runs back to back.

The engine that waits blocks on its command pipe (vLLM's engine core on its input queue), and
the driver pauses `--settle` seconds between passes so that the last pass's threads have stopped
spinning: vLLM's worker process stays at one full core for 1.2-2 s after its pass ends (sampled
from /proc at 0.5 s), dsinfer's for under 0.5 s, so with 1 s dsinfer's pass after vLLM's started
beside that spin. The load average is recorded before and after.

Reported per dtype: each engine's output tok/s per pass and their medians, dsinfer / vLLM per
pair with the median and range of those ratios (what the issue's target is judged on), and the
standalone timed pass of each worker.

    .venv/bin/python benchmarks/offline_paired.py --pairs 10 \\
        --python /work/main/.venv/bin/python --vllm-python /work/peers/vllm/bin/python \\
        --out benchmarks/results/offline_paired.json --markdown benchmarks/results/offline_paired.md
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import statistics
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from offline_throughput import (
    VLLM_MODES,
    RunSpec,
    end_group,
    make_workload,
    start_worker,
)

from harness.plots import plot_result
from harness.provenance import load_average, run_machine
from harness.results import add_output_args, machine_lines, save_report, table
from harness.server import Server

ENGINES = ("dsinfer", "vllm")


@dataclass
class Worker:
    """One engine's worker process, up between passes."""

    spec: RunSpec
    server: Server
    passes: Path
    commands: IO[str] | None = None

    def lines(self) -> list[dict[str, Any]]:
        text = self.passes.read_text() if self.passes.exists() else ""
        return [json.loads(line) for line in text.splitlines()]

    def wait_lines(self, count: int, timeout: float) -> list[dict[str, Any]]:
        """The worker's first ``count`` lines, once written; fails if it exits or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        process = self.server.process
        assert process is not None
        while len(lines := self.lines()) < count:
            if process.poll() is not None:
                raise RuntimeError(
                    f"{self.spec.name} exited with {process.returncode}: {self.server.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.spec.name}: no answer in {timeout:.0f}s: {self.server.log_tail()}")
            time.sleep(0.05)
        return lines

    def timed_pass(self, timeout: float) -> dict[str, Any]:
        assert self.commands is not None
        count = len(self.lines())
        self.commands.write("pass\n")
        self.commands.flush()
        return self.wait_lines(count + 1, timeout)[-1]


@contextmanager
def started(spec: RunSpec, python: str, args: argparse.Namespace, run_dir: Path) -> Iterator[Worker]:
    """A worker through its three passes and waiting for commands; its process group ended on exit."""
    os.mkfifo(spec.options["commands"])
    server, done, relay = start_worker(spec, python, args, run_dir)
    worker = Worker(spec, server, Path(spec.options["passes"]))
    try:
        worker.wait_lines(1, args.timeout)  # {"ready": true}
        worker.commands = _open_commands(worker, timeout=60)
        yield worker
        worker.commands.write("stop\n")
        worker.commands.close()
        worker.commands = None
        _wait_result(worker, args.timeout)
    finally:
        if worker.commands is not None:
            worker.commands.close()
        end_group(server.pid)
        done.set()
        relay.join(timeout=10)


def _open_commands(worker: Worker, timeout: float) -> IO[str]:
    """The FIFO's write end, once the worker has opened its read end (bounded: it may have died)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            fd = os.open(worker.spec.options["commands"], os.O_WRONLY | os.O_NONBLOCK)
        except OSError as e:  # ENXIO: no reader yet
            alive = worker.server.process is not None and worker.server.process.poll() is None
            if e.errno != errno.ENXIO or not alive or time.monotonic() > deadline:
                raise
            time.sleep(0.05)
            continue
        os.set_blocking(fd, True)
        return os.fdopen(fd, "w")


def _wait_result(worker: Worker, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not Path(worker.spec.result).exists():
        if time.monotonic() > deadline or worker.server.process.poll() not in (None, 0):  # type: ignore[union-attr]
            raise RuntimeError(f"{worker.spec.name}: no result: {worker.server.log_tail()}")
        time.sleep(0.1)


def _spec(engine: str, dtype: str, args: argparse.Namespace, workload: Path, run_dir: Path) -> RunSpec:
    name = f"{engine}_{dtype}"
    return RunSpec(
        engine=engine,
        dtype=dtype,
        variant=args.vllm_mode if engine == "vllm" else "default",
        model=str(args.model),
        workload=str(workload),
        output_len=args.output_len,
        warmup_output_len=args.output_len,
        compare_prompts=0,
        result=str(run_dir / f"{name}.result.json"),
        options={"commands": str(run_dir / f"{name}.commands"), "passes": str(run_dir / f"{name}.passes")},
    )


def run_dtype(dtype: str, args: argparse.Namespace, workload: Path, run_dir: Path) -> dict[str, Any]:
    pythons = {"dsinfer": args.python, "vllm": args.vllm_python}
    tok_s: dict[str, list[float]] = {e: [] for e in ENGINES}
    with ExitStack() as stack:
        workers = {  # one after the other: loading both at once would time neither's warm-up fairly
            e: stack.enter_context(
                started(_spec(e, dtype, args, workload, run_dir), pythons[e], args, run_dir)
            )
            for e in ENGINES
        }
        for pair in range(args.pairs):
            for engine in ENGINES if pair % 2 == 0 else ENGINES[::-1]:
                time.sleep(args.settle)
                line = workers[engine].timed_pass(args.timeout)
                tok_s[engine].append(line["output_tokens"] / line["wall_s"])
            print(
                f"{dtype} pair {pair}: dsinfer {tok_s['dsinfer'][-1]:,.0f} vllm {tok_s['vllm'][-1]:,.0f} tok/s "
                f"({tok_s['dsinfer'][-1] / tok_s['vllm'][-1]:.2f}x)",
                flush=True,
            )
    standalone = {}
    for engine, worker in workers.items():
        result = json.loads(Path(worker.spec.result).read_text())
        standalone[engine] = result["timed"]["output_tok_s"]
        if engine == "vllm":
            vllm_version = result["versions"]["vllm"]
    ratios = [d / v for d, v in zip(tok_s["dsinfer"], tok_s["vllm"], strict=True)]
    return {
        "dtype": dtype,
        "tok_s": tok_s,
        "median_tok_s": {e: statistics.median(v) for e, v in tok_s.items()},
        "ratios": ratios,
        "median_ratio": statistics.median(ratios),
        "standalone_tok_s": standalone,
        "vllm_version": vllm_version,
    }


COLUMNS = (
    "dtype",
    "dsinfer tok/s",
    "vLLM tok/s",
    "dsinfer / vLLM",
    "range",
    "first timed pass (dsinfer / vLLM)",
)


def markdown(report: dict[str, Any]) -> str:
    w = report["workload"]
    rows = [
        (r["dtype"], f"{r['median_tok_s']['dsinfer']:,.0f}", f"{r['median_tok_s']['vllm']:,.0f}",
         f"**{r['median_ratio']:.2f}x**", f"{min(r['ratios']):.2f}-{max(r['ratios']):.2f}",
         f"{r['standalone_tok_s']['dsinfer']:,.0f} / {r['standalone_tok_s']['vllm']:,.0f}")
        for r in report["rows"]
    ]  # fmt: skip
    return "\n".join(
        [
            "# Offline throughput, dsinfer against vLLM in pairs of passes (both engines up)",
            "",
            *machine_lines(report["machine"]),
            f"- checkpoint {report['model']}; {w['num_prompts']} prompts x {w['input_len']} tokens in, "
            f"{w['output_len']} out (greedy, ignore_eos); vLLM {report['rows'][0]['vllm_version']} "
            f"({report['vllm_mode']}); cores {report['cores']}",
            f"- {report['pairs']} pairs of timed passes per dtype, alternating which engine goes first, "
            f"{report['settle']} s between passes",
            "",
            "Output tokens per second (medians of the passes); dsinfer / vLLM: the median of the pairs' "
            "ratios (their range beside it):",
            "",
            *table(COLUMNS, rows, "lrrrrr"),
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--settle", type=float, default=3.0, help="seconds between passes")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--model", type=Path, default=Path("/work/bench-scratch/ckpt/tiny-f32"))
    parser.add_argument("--scratch", type=Path, default=Path("/work/bench-scratch"))
    parser.add_argument("--cores", default="0,1", help="taskset -c list for both engines")
    parser.add_argument("--kv-cache-gb", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument("--vllm-reserved-cpus", type=int, default=0, help="VLLM_CPU_NUM_OF_RESERVED_CPU")
    parser.add_argument("--vllm-mode", choices=VLLM_MODES, default="compile")
    parser.add_argument("--python", default=".venv/bin/python", help="dsinfer's python")
    parser.add_argument("--vllm-python", default="/work/peers/vllm/bin/python")
    parser.add_argument("--timeout", type=float, default=900, help="seconds for a worker's start or one pass")
    add_output_args(parser)
    args = parser.parse_args()
    machine = run_machine()
    for sub in ("tmp", "vllm-cache", "inductor-cache"):
        (args.scratch / sub).mkdir(parents=True, exist_ok=True)
    run_dir = args.scratch / "runs" / f"paired-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir.mkdir(parents=True)
    if not (args.model / "config.json").exists():
        raise SystemExit(f"no checkpoint at {args.model}: build it with benchmarks/make_bench_checkpoint.py")
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    workload = run_dir / "workload.json"
    workload.write_text(json.dumps(make_workload(args.num_prompts, args.input_len, 0.0, vocab, seed=0)))
    rows = [run_dtype(dtype, args, workload, run_dir) for dtype in args.dtypes.split(",")]
    machine["load_after"] = load_average()
    report = {
        "machine": machine,
        "model": str(args.model),
        "workload": {
            "num_prompts": args.num_prompts,
            "input_len": args.input_len,
            "output_len": args.output_len,
        },
        "cores": args.cores,
        "vllm_mode": args.vllm_mode,
        "pairs": args.pairs,
        "settle": args.settle,
        "rows": rows,
    }
    save_report(report, markdown(report), args.out, args.markdown)
    plot_result(args.out)


if __name__ == "__main__":
    main()
