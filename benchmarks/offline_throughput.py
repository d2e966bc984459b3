"""Offline (batch) generation throughput: dsinfer vs vLLM's CPU build vs transformers' generate.

Every engine reads the same checkpoint files (benchmarks/make_bench_checkpoint.py) and runs the same
seeded workload: N prompts of random token ids, greedy, a fixed number of output tokens with
ignore_eos. Each (engine, dtype, variant) runs in its own subprocess pinned with `taskset` to the
same cores, vLLM from its own virtualenv, the others from dsinfer's. A subprocess loads the model,
runs one warm-up pass over the whole workload, one prefill-only pass (max_tokens=1) and one timed pass.

Reported per run:
  * input tok/s and output tok/s of the timed pass (prompt tokens / wall, generated tokens / wall);
  * TTFT and TPOT percentiles (p50/p90/p99) over the requests. How they are measured depends on the
    engine and is written into every result as `timing_method`:
      - vllm: per request from `RequestOutput.metrics` (disable_log_stats=False): TTFT =
        first_token_latency (arrival to first token), TPOT = (last_token_ts - first_token_ts) /
        (generated - 1);
      - transformers: a streamer timestamps every decoding step of the batched generate(); every
        request shares the batch's timings (TTFT = start to first step, TPOT = mean step after it);
      - dsinfer: per request from the result's `metrics` if it has vLLM-like fields, otherwise the
        batch approximation TTFT = wall of the prefill-only pass, TPOT = (timed wall - that) / (out - 1);
  * `prefill_pass_s`: the wall time of the max_tokens=1 pass, for every engine (a uniform TTFT proxy);
  * peak RSS of the engine subprocess and every process it started (vLLM runs three), sampled from
    the driver, and the worker's own ru_maxrss;
  * greedy tokens of the first `--compare-prompts` prompts, compared with transformers in float32
    (fraction of prompts with identical tokens; never fails the benchmark).

Example (the committed results):

    /work/venv/bin/python benchmarks/offline_throughput.py --engines vllm,transformers \\
        --dtypes bfloat16,float32 --num-prompts 64 --input-len 32 --output-len 128 \\
        --out benchmarks/results/offline_batch64_peers.json \\
        --markdown benchmarks/results/offline_batch64_peers.md

`--worker SPEC` is the subprocess entry point: it runs under the engine's interpreter (vLLM's
virtualenv has neither dsinfer nor the harness), so this file imports only the standard library
at the top, the engines in their workers and the harness in the driver's functions.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).resolve()
PROGRESS = "@@progress "
ENGINES = ("vllm", "transformers", "dsinfer")
DTYPES = ("bfloat16", "float32")
VLLM_MODES = ("compile", "eager")
# peers.md: vLLM's custom CPU rotary-embedding op is wrong for 3-D queries; always switch it off.
VLLM_CUSTOM_OPS = ["all", "-rotary_embedding"]


# --------------------------------------------------------------------------------------------
# Shared helpers (driver and workers)
# --------------------------------------------------------------------------------------------


def progress(msg: str) -> None:
    """One progress line; the driver relays lines with this prefix."""
    print(f"{PROGRESS}{msg}", flush=True)


def make_workload(
    num_prompts: int, input_len: int, input_len_jitter: float, vocab_size: int, seed: int
) -> list[list[int]]:
    """N prompts of random token ids in [2, vocab) (0/1 are bos/eos). Lengths are `input_len`, or
    uniform in input_len * [1 - jitter, 1 + jitter] when jitter > 0."""
    rng = random.Random(seed)
    lo = max(1, round(input_len * (1 - input_len_jitter)))
    hi = max(lo, round(input_len * (1 + input_len_jitter)))
    prompts = []
    for _ in range(num_prompts):
        n = rng.randint(lo, hi) if input_len_jitter > 0 else input_len
        prompts.append([rng.randrange(2, vocab_size) for _ in range(n)])
    return prompts


@dataclass
class RunSpec:
    """What one worker subprocess runs (written as JSON for it)."""

    engine: str
    dtype: str
    variant: str
    model: str
    workload: str  # path of a JSON list of token-id lists
    output_len: int
    warmup_output_len: int
    compare_prompts: int
    result: str  # where the worker writes its result JSON
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.engine}/{self.dtype}/{self.variant}"


# --------------------------------------------------------------------------------------------
# Workers (run inside the pinned subprocess; import their engine lazily)
# --------------------------------------------------------------------------------------------


class Skip(Exception):
    """The engine cannot run here (not installed / API missing); reported, not an error."""


def _num_cores() -> int:
    return len(os.sched_getaffinity(0))


def _rusage() -> dict[str, int]:
    return {
        "ru_maxrss_self_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
        "ru_maxrss_children_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024,
    }


def _pass_record(
    wall: float, prompts: list[list[int]], outputs: list[list[int]], ttft: list[float], tpot: list[float]
) -> dict[str, Any]:
    n_in = sum(len(p) for p in prompts)
    n_out = sum(len(o) for o in outputs)
    return {
        "wall_s": wall,
        "input_tokens": n_in,
        "output_tokens": n_out,
        "input_tok_s": n_in / wall,
        "output_tok_s": n_out / wall,
        "ttft_s": ttft,  # per request: the driver turns them into percentiles
        "tpot_s": tpot,
    }


def _run_record(
    versions: dict[str, str],
    options: dict[str, Any],
    seconds: tuple[float, float, float],
    timed: dict[str, Any],
    method: str,
    tokens: list[list[int]],
) -> dict[str, Any]:
    """What a worker reports: versions, options, (load, warm-up, prefill pass) seconds, the timed
    pass, how its timings were measured and its tokens."""
    load_s, warmup_s, prefill_s = seconds
    return {
        "versions": versions,
        "engine_options": options,
        "load_s": load_s,
        "warmup_s": warmup_s,
        "prefill_pass_s": prefill_s,
        "timed": timed,
        "timing_method": method,
        "tokens": tokens,
    }


def _three_passes(
    generate: Callable[[int], tuple[float, Any]], spec: RunSpec, load_s: float
) -> tuple[float, float, float, Any]:
    """The same passes for every engine: warm-up, prefill-only (max_tokens=1), timed.
    Returns (warm-up s, prefill s, timed s, the timed pass's outputs)."""
    progress(f"loaded in {load_s:.1f}s; warm-up pass ({spec.warmup_output_len} tokens)")
    warmup_s, _ = generate(spec.warmup_output_len)
    progress(f"warm-up {warmup_s:.2f}s; prefill-only pass")
    prefill_s, _ = generate(1)
    progress(f"prefill pass {prefill_s:.3f}s; timed pass ({spec.output_len} tokens)")
    wall, outs = generate(spec.output_len)
    if "commands" in spec.options:
        _passes_on_command(generate, spec)
    return warmup_s, prefill_s, wall, outs


def _passes_on_command(generate: Callable[[int], tuple[float, Any]], spec: RunSpec) -> None:
    """Paired mode (offline_paired.py): after the three passes, one more timed pass per ``pass``
    line read from the FIFO ``options["commands"]``, until ``stop`` or its end. Each pass appends
    a JSON line {"wall_s", "output_tokens"} to ``options["passes"]``; a first line {"ready": true}
    says the worker is waiting for commands."""
    passes = Path(spec.options["passes"])

    def record(line: dict[str, Any]) -> None:
        with passes.open("a") as f:
            f.write(json.dumps(line) + "\n")

    record({"ready": True})
    with open(spec.options["commands"]) as commands:
        for command in commands:
            if command.strip() != "pass":
                break
            wall, outs = generate(spec.output_len)
            record({"wall_s": wall, "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs)})
            progress(f"paired pass {wall:.2f}s")


def run_vllm(spec: RunSpec, prompts: list[list[int]]) -> dict[str, Any]:
    try:
        import torch
        import vllm
        from vllm import LLM, SamplingParams
    except ImportError as e:
        raise Skip(f"vllm not importable: {e}") from e

    max_len = max(len(p) for p in prompts) + max(spec.output_len, spec.warmup_output_len) + 16
    kwargs: dict[str, Any] = {
        "model": spec.model,
        "dtype": spec.dtype,
        "seed": 0,
        "max_model_len": max(max_len, 256),
        "max_num_seqs": max(len(prompts), 1),
        "disable_log_stats": False,  # fills RequestOutput.metrics
        "enforce_eager": spec.variant == "eager",
        "compilation_config": {"custom_ops": VLLM_CUSTOM_OPS},
    }
    if spec.dtype == "float32":
        kwargs["attention_backend"] = "CPU_MLA"  # the default CPU MLA backend takes bf16 only
    progress(f"loading vllm {vllm.__version__} ({'enforce_eager' if spec.variant == 'eager' else 'compile'})")
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    load_s = time.perf_counter() - t0
    inputs = [{"prompt_token_ids": p} for p in prompts]

    def params(n: int) -> Any:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)

    def generate(n: int) -> tuple[float, list[Any]]:
        t = time.perf_counter()
        outs = llm.generate(inputs, params(n), use_tqdm=False)
        return time.perf_counter() - t, outs

    warmup_s, prefill_s, wall, outs = _three_passes(generate, spec, load_s)

    progress(f"timed pass {wall:.2f}s; shutting the engine down")
    try:
        llm.llm_engine.engine_core.shutdown(timeout=30)
    except Exception as e:  # the processes are killed by the driver anyway
        progress(f"engine shutdown: {e!r}")

    tokens = [list(o.outputs[0].token_ids) for o in outs]
    ttft, tpot = [], []
    for o in outs:
        m = o.metrics
        if m is None:
            continue
        ttft.append(float(m.first_token_latency))
        if m.num_generation_tokens > 1:
            tpot.append((m.last_token_ts - m.first_token_ts) / (m.num_generation_tokens - 1))
    method = (
        "per request from RequestOutput.metrics: TTFT = first_token_latency (arrival -> first token), "
        "TPOT = (last_token_ts - first_token_ts) / (generated - 1)"
    )
    return _run_record(
        {"vllm": vllm.__version__, "torch": torch.__version__},
        {k: v for k, v in kwargs.items() if k != "model"},
        (load_s, warmup_s, prefill_s),
        _pass_record(wall, prompts, tokens, ttft, tpot),
        method,
        tokens,
    )


def run_transformers(spec: RunSpec, prompts: list[list[int]]) -> dict[str, Any]:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.generation.streamers import BaseStreamer

    torch.set_num_threads(_num_cores())
    dtype = getattr(torch, spec.dtype)
    progress(f"loading transformers {transformers.__version__} ({torch.get_num_threads()} threads)")
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(spec.model, dtype=dtype).eval()
    load_s = time.perf_counter() - t0

    pad_id = 0
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1

    class StepClock(BaseStreamer):
        """Timestamps every put(): the first is the prompt, then one per generated step."""

        def __init__(self) -> None:
            self.stamps: list[float] = []

        def put(self, value: Any) -> None:
            self.stamps.append(time.perf_counter())

        def end(self) -> None:
            pass

    def generate(n: int) -> tuple[float, list[list[int]], StepClock]:
        # eos_token_id=None: never stop early and never mask eos (= vLLM's ignore_eos).
        config = GenerationConfig(
            do_sample=False, max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=pad_id
        )
        clock = StepClock()
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, generation_config=config, streamer=clock)
        wall = time.perf_counter() - t
        clock.stamps.insert(0, t)
        return wall, out[:, width:].tolist(), clock

    progress(f"loaded in {load_s:.1f}s; warm-up pass ({spec.warmup_output_len} tokens)")
    warmup_s, _, _ = generate(spec.warmup_output_len)
    progress(f"warm-up {warmup_s:.2f}s; prefill-only pass")
    prefill_s, _, _ = generate(1)
    progress(f"prefill pass {prefill_s:.3f}s; timed pass ({spec.output_len} tokens)")
    wall, tokens, clock = generate(spec.output_len)

    # stamps: [start, prompt put, step 1, step 2, ...]
    steps = clock.stamps[2:]
    ttft_one = steps[0] - clock.stamps[0] if steps else wall
    tpot_one = (steps[-1] - steps[0]) / (len(steps) - 1) if len(steps) > 1 else 0.0
    method = (
        "batched generate(): a streamer timestamps each step; all requests share TTFT = start -> first "
        "generated step, TPOT = mean time per step after it"
    )
    return _run_record(
        {"transformers": transformers.__version__, "torch": torch.__version__},
        {"threads": torch.get_num_threads(), "batch": len(prompts), "padding": "left"},
        (load_s, warmup_s, prefill_s),
        _pass_record(wall, prompts, tokens, [ttft_one] * len(prompts), [tpot_one] * len(prompts)),
        method,
        tokens,
    )


def run_dsinfer(spec: RunSpec, prompts: list[list[int]]) -> dict[str, Any]:
    try:
        import dsinfer
        from dsinfer import LLM, SamplingParams  # type: ignore[attr-defined]
    except ImportError as e:
        raise Skip(f"dsinfer.LLM not available yet ({e})") from e
    import torch

    torch.set_num_threads(_num_cores())
    progress(f"loading dsinfer ({torch.get_num_threads()} threads)")
    t0 = time.perf_counter()
    llm = LLM(model=spec.model, dtype=spec.dtype)
    load_s = time.perf_counter() - t0

    def generate(n: int) -> tuple[float, list[Any]]:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        t = time.perf_counter()
        outs = llm.generate(prompts, params)
        return time.perf_counter() - t, list(outs)

    warmup_s, prefill_s, wall, outs = _three_passes(generate, spec, load_s)
    tokens = [list(o.outputs[0].token_ids) for o in outs]

    ttft, tpot = _dsinfer_request_timings(outs)
    if ttft:
        method = "per request from the result's metrics (first_token_latency / first and last token times)"
    else:
        method = (
            "batch approximation: TTFT = wall of the prefill-only (max_tokens=1) pass, "
            "TPOT = (timed wall - that) / (output_len - 1), the same for every request"
        )
        ttft = [prefill_s] * len(prompts)
        tpot = [(wall - prefill_s) / max(spec.output_len - 1, 1)] * len(prompts)
    return _run_record(
        {"dsinfer": getattr(dsinfer, "__version__", "?"), "torch": torch.__version__},
        {"threads": torch.get_num_threads()},
        (load_s, warmup_s, prefill_s),
        _pass_record(wall, prompts, tokens, ttft, tpot),
        method,
        tokens,
    )


def _dsinfer_request_timings(outs: list[Any]) -> tuple[list[float], list[float]]:
    """Per-request TTFT/TPOT if dsinfer's results carry vLLM-like metrics, else empty lists."""
    ttft: list[float] = []
    tpot: list[float] = []
    for o in outs:
        m = getattr(o, "metrics", None)
        first = getattr(m, "first_token_latency", None)
        if m is None or first is None:
            return [], []
        ttft.append(float(first))
        t_first, t_last = getattr(m, "first_token_ts", None), getattr(m, "last_token_ts", None)
        n = len(o.outputs[0].token_ids)
        if t_first is not None and t_last is not None and n > 1:
            tpot.append((t_last - t_first) / (n - 1))
    return ttft, tpot


WORKERS: dict[str, Callable[[RunSpec, list[list[int]]], dict[str, Any]]] = {
    "vllm": run_vllm,
    "transformers": run_transformers,
    "dsinfer": run_dsinfer,
}


def worker_main(spec_path: str) -> int:
    spec = RunSpec(**json.loads(Path(spec_path).read_text()))
    prompts = json.loads(Path(spec.workload).read_text())
    result: dict[str, Any] = {"status": "ok", "cores": sorted(os.sched_getaffinity(0))}
    try:
        result.update(WORKERS[spec.engine](spec, prompts))
    except Skip as e:
        result = {"status": "skipped", "reason": str(e)}
        progress(f"skipped: {e}")
    result.update(_rusage())
    Path(spec.result).write_text(json.dumps(result))
    progress("done")
    # vLLM's shutdown can hang on a background thread; the result is written, so leave now.
    sys.stdout.flush()
    os._exit(0)


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------


def relay_progress(log_path: Path, done: threading.Event, name: str, t0: float) -> None:
    """Print the worker's progress lines as they reach its log, until ``done`` and the log's end."""
    with log_path.open(errors="replace") as log:
        while True:
            line = log.readline()
            if not line:
                if done.is_set():
                    return
                time.sleep(0.1)
            elif line.startswith(PROGRESS):
                elapsed = time.perf_counter() - t0
                print(f"[{name}] {elapsed:7.1f}s {line[len(PROGRESS) :].rstrip()}", flush=True)


def end_group(pgid: int, grace: float = 10.0) -> None:
    """SIGTERM the worker's process group (its session), then SIGKILL what is left."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)


def start_worker(
    spec: RunSpec, python: str, args: argparse.Namespace, log_dir: Path
) -> tuple[Any, threading.Event, threading.Thread]:
    """One pinned worker for ``spec`` started, its progress lines relayed until the returned event
    is set: (its ``harness.server.Server``, that event, the relaying thread)."""
    from harness.server import Server, engine_env

    spec_path = log_dir / f"{spec.name.replace('/', '_')}.spec.json"
    log_path = log_dir / f"{spec.name.replace('/', '_')}.log"
    spec_path.write_text(json.dumps(asdict(spec)))
    Path(spec.result).unlink(missing_ok=True)
    cmd = ["taskset", "-c", args.cores, python, str(SCRIPT), "--worker", str(spec_path)]
    env = engine_env(spec.engine, Path(args.scratch), args.cores, args.kv_cache_gb, args.vllm_reserved_cpus)
    print(f"[{spec.name}] start: {shlex.join(cmd)} (log {log_path})", flush=True)
    t0 = time.perf_counter()
    # A session of its own (as a server's), so that whatever the worker leaves behind (vLLM's
    # engine processes, multiprocessing's resource tracker) can be ended as a group.
    worker = Server(cmd, 0, log_path)
    worker.start(env, cwd=REPO_ROOT)
    done = threading.Event()
    reader = threading.Thread(target=relay_progress, args=(log_path, done, spec.name, t0), daemon=True)
    reader.start()
    return worker, done, reader


def run_one(spec: RunSpec, python: str, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    """Launch one pinned worker, relay its progress lines, sample its RSS, return its result."""
    from harness.metrics import RssSampler, session_pids
    from harness.results import percentiles

    t0 = time.perf_counter()
    worker, done, reader = start_worker(spec, python, args, log_dir)
    proc = worker.process
    assert proc is not None
    sampler = RssSampler(lambda: session_pids(proc.pid)).start()
    try:
        rc = proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        print(f"[{spec.name}] timed out after {args.timeout:.0f}s", flush=True)
        rc = -9
    sampler.stop()
    end_group(proc.pid)
    done.set()
    reader.join(timeout=30)
    result_file = Path(spec.result)
    if result_file.exists():
        result = json.loads(result_file.read_text())
        if "timed" in result:
            for key in ("ttft_s", "tpot_s"):
                result["timed"][key] = percentiles(result["timed"][key])
    else:
        reason = f"worker exited with {rc} and no result (see {worker.log_path})"
        result = {"status": "failed", "reason": reason}
        print(f"[{spec.name}] FAILED: {reason}", flush=True)
    result.update(
        {
            "engine": spec.engine,
            "dtype": spec.dtype,
            "variant": spec.variant,
            "peak_rss_tree_mib": sampler.peak_mib,
            "subprocess_wall_s": time.perf_counter() - t0,
            "log": str(worker.log_path),
        }
    )
    if result["status"] == "ok":
        t = result["timed"]
        print(
            f"[{spec.name}] result: {t['output_tok_s']:.0f} output tok/s, {t['input_tok_s']:.0f} input tok/s, "
            f"peak RSS {sampler.peak_mib:.0f} MiB",
            flush=True,
        )
    return result


def compare_tokens(results: list[dict[str, Any]], k: int) -> None:
    """Adds `match_vs_transformers_f32` (fraction of the first k prompts with identical greedy
    tokens) and `mean_common_prefix` to every ok result, when transformers/float32 ran."""
    ref = next(
        (
            r
            for r in results
            if r["status"] == "ok" and r["engine"] == "transformers" and r["dtype"] == "float32"
        ),
        None,
    )
    for r in results:
        if r["status"] != "ok" or ref is None:
            continue
        pairs = list(zip(r["tokens"][:k], ref["tokens"][:k], strict=False))
        same = sum(a == b for a, b in pairs)
        prefix = []
        for a, b in pairs:
            n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            prefix.append(n / max(len(b), 1))
        r["match_vs_transformers_f32"] = {
            "prompts_compared": len(pairs),
            "identical_fraction": same / len(pairs) if pairs else None,
            "mean_common_prefix_fraction": sum(prefix) / len(prefix) if prefix else None,
        }


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def _pcts(d: dict[str, float | None]) -> str:
    return " / ".join(_ms(d.get(f"p{q}")) for q in (50, 90, 99))


def markdown_report(report: dict[str, Any]) -> str:
    w, m = report["workload"], report["machine"]
    lines = [
        f"# Offline throughput: {w['num_prompts']} prompts x {w['input_len']} tokens in, "
        f"{w['output_len']} out (greedy, ignore_eos)",
        "",
        f"- Machine: {m['cpu_model']}, cores used {m['cores_used']} of {m['online_cpus']} "
        f"(taskset), {m['mem_total_gib']} GiB; ISA: {', '.join(m['cpu_isa']) or '-'}",
        f"- Checkpoint: `{report['model']}` (tiny DeepSeek-V3, float32 files; each engine casts to the dtype)",
        f"- Workload seed {w['seed']}, input-length jitter {w['input_len_jitter']}; "
        f"warm-up pass of {w['warmup_output_len']} tokens before the timed pass",
        f"- Date: {report['date']}; dsinfer commit {report['dsinfer_git']['commit'][:12]}"
        f"{' (dsinfer/ modified)' if report['dsinfer_git']['dirty'] else ''}",
        f"- Command: `{report['command']}`",
        "",
        "| engine | dtype | variant | output tok/s | input tok/s | timed wall s | prefill pass s "
        "| TTFT p50/p90/p99 ms | TPOT p50/p90/p99 ms | peak RSS MiB | same tokens as HF f32 |",
        "|---|---|---|---:|---:|---:|---:|---|---|---:|---|",
    ]
    for r in report["results"]:
        name = f"| {r['engine']} | {r['dtype']} | {r['variant']} "
        if r["status"] != "ok":
            lines.append(name + f"| {r['status']}: {r.get('reason', '')} | | | | | | | |")
            continue
        t = r["timed"]
        match = r.get("match_vs_transformers_f32")
        match_s = (
            f"{match['identical_fraction']:.0%} of {match['prompts_compared']} "
            f"(common prefix {match['mean_common_prefix_fraction']:.0%})"
            if match and match["identical_fraction"] is not None
            else "-"
        )
        lines.append(
            name + f"| {t['output_tok_s']:,.0f} | {t['input_tok_s']:,.0f} | {t['wall_s']:.2f} "
            f"| {r['prefill_pass_s']:.3f} | {_pcts(t['ttft_s'])} | {_pcts(t['tpot_s'])} "
            f"| {r['peak_rss_tree_mib']:,.0f} | {match_s} |"
        )
    best = report.get("best")
    if best:
        lines += ["", "Best configuration per engine and dtype (output tok/s):", ""]
        lines += ["| engine | dtype | best variant | output tok/s |", "|---|---|---|---:|"]
        lines += [
            f"| {b['engine']} | {b['dtype']} | {b['variant']} | {b['output_tok_s']:,.0f} |" for b in best
        ]
    lines += ["", "How the timings are measured:", ""]
    seen = set()
    for r in report["results"]:
        if r["status"] == "ok" and r["engine"] not in seen:
            seen.add(r["engine"])
            lines.append(f"- {r['engine']}: {r['timing_method']}")
    lines.append(
        "- peak RSS: the engine subprocess and every process it started (its session), VmRSS summed, sampled every 0.25 s"
    )
    return "\n".join(lines) + "\n"


def best_per_dtype(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    best: dict[tuple[str, str], dict[str, Any]] = {}
    for r in results:
        if r["status"] != "ok":
            continue
        key = (r["engine"], r["dtype"])
        if key not in best or r["timed"]["output_tok_s"] > best[key]["timed"]["output_tok_s"]:
            best[key] = r
    return [
        {"engine": e, "dtype": d, "variant": r["variant"], "output_tok_s": r["timed"]["output_tok_s"]}
        for (e, d), r in best.items()
    ]


def plan(args: argparse.Namespace, workload: Path, result_dir: Path) -> list[tuple[RunSpec, str]]:
    engines = [e for e in args.engines.split(",") if e]
    dtypes = [d for d in args.dtypes.split(",") if d]
    for e in engines:
        if e not in ENGINES:
            raise SystemExit(f"unknown engine {e!r} (choose from {', '.join(ENGINES)})")
    for d in dtypes:
        if d not in DTYPES:
            raise SystemExit(f"unknown dtype {d!r} (choose from {', '.join(DTYPES)})")
    vllm_modes = [m for m in args.vllm_modes.split(",") if m]
    # transformers first: it is the reference the others are compared with.
    order = sorted(engines, key=lambda e: {"transformers": 0, "vllm": 1, "dsinfer": 2}[e])
    runs: list[tuple[RunSpec, str]] = []
    for engine in order:
        variants = vllm_modes if engine == "vllm" else ["generate" if engine == "transformers" else "default"]
        python = args.vllm_python if engine == "vllm" else args.python
        for dtype in dtypes:
            for variant in variants:
                spec = RunSpec(
                    engine=engine,
                    dtype=dtype,
                    variant=variant,
                    model=str(args.model),
                    workload=str(workload),
                    output_len=args.output_len,
                    warmup_output_len=args.warmup_output_len or args.output_len,
                    compare_prompts=args.compare_prompts,
                    result=str(result_dir / f"{engine}_{dtype}_{variant}.result.json"),
                )
                runs.append((spec, python))
    return runs


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--engines", default="vllm,transformers,dsinfer")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument(
        "--vllm-modes", default="compile,eager", help="vLLM variants: compile (torch.compile), eager"
    )
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--input-len-jitter", type=float, default=0.0, help="lengths uniform in len*(1 +- jitter)")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--warmup-output-len", type=int, default=0, help="default: --output-len")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare-prompts", type=int, default=8, help="prompts whose tokens are compared")
    p.add_argument("--model", type=Path, default=Path("/work/bench-scratch/ckpt/tiny-f32"))
    p.add_argument("--scratch", type=Path, default=Path("/work/bench-scratch"))
    p.add_argument("--cores", default="0,1", help="taskset -c list for every engine")
    p.add_argument("--kv-cache-gb", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument(
        "--vllm-reserved-cpus",
        type=int,
        help="VLLM_CPU_NUM_OF_RESERVED_CPU (vLLM's default keeps one of the cores for its scheduler)",
    )
    p.add_argument("--python", default="/work/venv/bin/python", help="python for transformers and dsinfer")
    p.add_argument("--vllm-python", default="/work/vllm-venv/bin/python")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per engine subprocess")
    p.add_argument("--out", type=Path, help="results JSON")
    p.add_argument("--markdown", type=Path, help="markdown table (also printed)")
    p.add_argument("--render", type=Path, help="only re-render the markdown of this results JSON")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args.worker)
    from harness.plots import plot_result
    from harness.provenance import command_line, git_state, machine_info, parse_cpu_list
    from harness.results import write_json

    if args.render:  # re-render the markdown of an existing results JSON
        md = markdown_report(json.loads(args.render.read_text()))
        print(md, end="")
        if args.markdown:
            args.markdown.write_text(md)
        return 0

    command = command_line()
    scratch: Path = args.scratch
    for sub in ("tmp", "vllm-cache", "inductor-cache"):
        (scratch / sub).mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir = scratch / "runs" / stamp
    run_dir.mkdir(parents=True)

    if not (args.model / "config.json").exists():
        print(f"building the benchmark checkpoint at {args.model}", flush=True)
        make = REPO_ROOT / "benchmarks" / "make_bench_checkpoint.py"
        subprocess.run([args.python, str(make), "--out", str(args.model)], check=True)
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    prompts = make_workload(args.num_prompts, args.input_len, args.input_len_jitter, vocab, args.seed)
    workload = run_dir / "workload.json"
    workload.write_text(json.dumps(prompts))
    print(
        f"workload: {len(prompts)} prompts, {sum(map(len, prompts))} input tokens, {args.output_len} out each; "
        f"run dir {run_dir}",
        flush=True,
    )

    results = [run_one(spec, python, args, run_dir) for spec, python in plan(args, workload, run_dir)]
    compare_tokens(results, args.compare_prompts)
    for r in results:  # keep the compared prompts' tokens only
        if "tokens" in r:
            r["tokens"] = r["tokens"][: args.compare_prompts]

    report = {
        "benchmark": "offline_throughput",
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": command,
        "machine": {**machine_info(), "cores_used": parse_cpu_list(args.cores)},
        "dsinfer_git": git_state(("dsinfer",)),
        "model": str(args.model),
        "workload": {
            "num_prompts": args.num_prompts,
            "input_len": args.input_len,
            "input_len_jitter": args.input_len_jitter,
            "output_len": args.output_len,
            "warmup_output_len": args.warmup_output_len or args.output_len,
            "seed": args.seed,
            "greedy": True,
            "ignore_eos": True,
        },
        "env": {
            "VLLM_CPU_KVCACHE_SPACE": args.kv_cache_gb,
            "VLLM_CPU_NUM_OF_RESERVED_CPU": args.vllm_reserved_cpus,
            "TMPDIR/VLLM_CACHE_ROOT/TORCHINDUCTOR_CACHE_DIR": str(scratch),
        },
        "results": results,
        "best": best_per_dtype(results),
    }
    md = markdown_report(report)
    print(md, flush=True)
    if args.out:
        write_json(args.out, report)
        plot_result(args.out)
        print(f"wrote {args.out}", flush=True)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(md)
        print(f"wrote {args.markdown}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
