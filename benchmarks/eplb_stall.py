"""How long an online expert rebalance stalls a step of an expert-parallel pool.

The issue's target: no step longer than twice the median while expert weights move.

The script starts an EP pool of 2 (optionally 4) rank processes on this machine (gloo over
TCP, one torch thread and one numba thread per rank), each driving an ``LLMEngine`` with
``TorchEPGroup`` in lockstep as the serving loop does (each iteration ``engine.plan_step()``, the
one agreement all-reduce ``engine.agree()``, then ``engine.run_step()``). The model is the built-in tiny preset's config with larger MoE sizes
(written to a temp directory, ``load_format="dummy"``), so staging new experts takes many steps.
Workload: N prompts of random token ids (dealt round-robin to the ranks), greedy, a fixed output
length with ``ignore_eos``: after one prefill step every step is a steady decode step.

Each configuration runs twice: without rebalancing (``eplb_interval=0``) and with
``eplb_interval=K`` and ``eplb_min_gain=0`` (rebalance whenever EPLB proposes any different
placement, whatever the gain: the load of random dummy weights is nearly even, so a real
min_gain would usually skip it). The balancer stages the new experts on the serving thread, a
few pieces per step boundary under ``eplb_stage_budget`` x the median step (``--stage-budget``;
see dsinfer/engine/expert_balancer.py), swaps when every rank is done, then frees the replaced
weights a few tensors per boundary. Every rank times every ``run_step()`` call (which runs
the balancer's ``before_step`` too: the load all-reduce, placement and staging plan at a
decision, pieces while staging, the swap, the freeing) and the
balancer's own share of it; the pool's step time is the max over ranks per step index. From
``OnlineExpertBalancer.history`` each rebalance marks the steps while weights move: its decision
and staging window (the decision step up to the step before the swap), its swap step and the
steps freeing the replaced weights. Reported per run: the median of the steady steps (from step
``--warmup`` + 1 on, outside those steps), the max step of each kind as ratios to the median
(target <= 2.0), stage_seconds (the decision to the swap, wall clock), the pieces and the seconds
spent in them, and the same statistics of the run without rebalancing for comparison (its own
max/median is the noise floor: other work on the machine). A second configuration with bigger
experts makes staging span many more steps. After the timed loop every rank also builds all of
its experts once more on an idle pool (every expert read or drawn, none copied): the work of a
full restaging without serving beside it.

    /work/venv/bin/python benchmarks/eplb_stall.py \\
        --out benchmarks/results/eplb_stall.json --markdown benchmarks/results/eplb_stall.md

Internal: ``eplb_stall.py --rank-child SPEC_JSON`` is one rank of the pool.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from harness.plots import plot_result
from harness.provenance import REPO, git_commit, machine_info
from harness.rank_pool import PORT_TAKEN, exit_on_sigterm, grown_preset, join_pool, random_prompts, run_pool
from harness.results import ratio as _ratio
from harness.results import table, write_json

TARGET_RATIO = 2.0  # the issue: no step longer than twice the median while weights move

# name -> overrides of the tiny preset's config.json
CONFIGS: dict[str, dict[str, Any]] = {
    "standard": {
        "hidden_size": 768,
        "intermediate_size": 1536,
        "moe_intermediate_size": 384,
        "num_hidden_layers": 4,
        "n_routed_experts": 32,
        "n_group": 4,
        "topk_group": 2,
        "num_experts_per_tok": 4,
        "q_lora_rank": 256,
    },
    "slow-staging": {
        "hidden_size": 1024,
        "intermediate_size": 2048,
        "moe_intermediate_size": 512,
        "num_hidden_layers": 5,
        "n_routed_experts": 64,
        "n_group": 8,
        "topk_group": 4,
        "num_experts_per_tok": 4,
        "q_lora_rank": 256,
    },
}


# The rank child --------------------------------------------------------------------------------
def _schedstat(tid: int) -> tuple[float, float]:
    """(seconds on a CPU, seconds runnable but waiting for a CPU) of one thread of this process."""
    try:
        on_cpu, waiting, _ = Path(f"/proc/self/task/{tid}/schedstat").read_text().split()
    except (OSError, ValueError):
        return 0.0, 0.0
    return int(on_cpu) / 1e9, int(waiting) / 1e9


def rank_main(spec: dict[str, Any]) -> int:
    import logging
    import threading

    import torch.distributed as dist

    from dsinfer.base.sampling_params import SamplingParams
    from dsinfer.engine.args import EngineArgs
    from dsinfer.engine.engine import LLMEngine
    from dsinfer.model.moe import MoE
    from dsinfer.parallel.ep import TorchEPGroup

    rank, label = spec["rank"], spec["label"]
    logging.basicConfig(level=logging.WARNING, format=f"    [{label} rank {rank}] %(name)s: %(message)s")
    logging.getLogger("dsinfer.eplb").setLevel(logging.INFO)
    if not join_pool(spec, spec["dist_timeout"]):  # the port was taken meanwhile: the parent retries
        return PORT_TAKEN
    t_load = time.perf_counter()
    engine = LLMEngine(EngineArgs(model=spec["model"], **spec["engine"]), ep_group=TorchEPGroup())
    load_seconds = time.perf_counter() - t_load
    params = SamplingParams(temperature=0, max_tokens=spec["max_tokens"], ignore_eos=True)
    for rid, ids in spec["prompts"].items():
        engine.add_request(rid, ids, params)
    dist.barrier()
    step_s: list[float] = []
    iter_s: list[float] = []
    cpu_s: list[float] = []  # CPU time the stepping thread got during the step
    other_cpu_s: list[float] = []  # CPU time of the process's other threads (gloo's) meanwhile
    tokens: list[int] = []
    balancer = engine.expert_balancer
    balancer_s: list[float] = []  # the balancer's own share of each step (before_step)
    budget_s: list[float] = []  # the balancer's staging budget at each step boundary
    piece_s: list[float] = []  # of which in staging pieces
    if balancer is not None:
        before_step = balancer.before_step

        def timed_before_step(staging_anywhere: bool) -> None:
            t = time.perf_counter()
            budget_s.append(balancer.budget())
            work = sum(e.stage_work_seconds for e in balancer.history)
            before_step(staging_anywhere)
            balancer_s.append(time.perf_counter() - t)
            piece_s.append(sum(e.stage_work_seconds for e in balancer.history) - work)

        balancer.before_step = timed_before_step
    # per iteration (agreement + step), from the kernel's schedstat: the stepping thread's time on a
    # CPU and time runnable but waiting for one (the rest: blocked)
    sched: list[list[float]] = []
    main_tid = threading.get_native_id()
    start = time.perf_counter()
    while True:
        t0 = time.perf_counter()
        m1 = _schedstat(main_tid)
        plan = engine.plan_step()
        agreed = engine.agree(plan.votes)
        if not agreed.has_work:
            break
        t1, c1, p1 = time.perf_counter(), time.thread_time(), time.process_time()
        updates = engine.run_step(plan, agreed)
        m2 = _schedstat(main_tid)
        t2, c2, p2 = time.perf_counter(), time.thread_time(), time.process_time()
        sched.append([m2[0] - m1[0], m2[1] - m1[1]])
        step_s.append(t2 - t1)
        cpu_s.append(c2 - c1)
        other_cpu_s.append((p2 - p1) - (c2 - c1))
        iter_s.append(t2 - t0)
        tokens.append(sum(len(u.new_token_ids) for u in updates))
        if rank != 0:
            continue
        n = len(step_s)
        if n % spec["progress_every"] == 0:
            recent = sorted(step_s[-spec["progress_every"] :])
            events = ""
            if balancer is not None:
                events = "; rebalances " + (
                    ", ".join(f"step {e.step}->swap {e.swap_step}" for e in balancer.history) or "none yet"
                )
            print(
                f"    [{label}] step {n}: median of the last {len(recent)} {1e3 * recent[len(recent) // 2]:.1f} ms"
                f", max {1e3 * recent[-1]:.1f} ms{events}",
                file=sys.stderr,
                flush=True,
            )
    wall = time.perf_counter() - start
    history = [vars(e).copy() for e in balancer.history] if balancer is not None else []
    for event in history:
        event.pop("received_before", None)
    moes = [(name, m) for name, m in engine.model.named_modules() if isinstance(m, MoE)]
    rebuild_seconds = None
    if balancer is not None:
        # the work of staging every expert anew (read or drawn, none copied), the pool idle
        balancer.close()
        dist.barrier()
        t = time.perf_counter()
        for name, moe in moes:
            balancer.source.build(f"{name}.experts", moe.experts.expert_ids)
        rebuild_seconds = time.perf_counter() - t
    result = {
        "rank": rank,
        "load_seconds": load_seconds,
        "wall_seconds": wall,
        "step_seconds": step_s,
        "iteration_seconds": iter_s,
        "balancer_seconds": balancer_s,
        "budget_seconds": budget_s,
        "piece_seconds": piece_s,
        "cpu_seconds": cpu_s,
        "other_cpu_seconds": other_cpu_s,
        "sched": sched,
        "tokens": tokens,
        "history": history,
        "rebuild_all_experts_seconds": rebuild_seconds,
        "expert_bytes": sum(m.experts.w13.nbytes + m.experts.w2.nbytes for _, m in moes),
        "slots_per_layer": len(moes[0][1].experts.expert_ids),
        "moe_layers": len(moes),
    }
    Path(spec["out"]).write_text(json.dumps(result))
    dist.barrier()
    engine.close()
    dist.destroy_process_group()
    return 0


# The parent: pools, statistics, report ---------------------------------------------------------
def pool_specs(
    args: argparse.Namespace, world: int, model: Path, label: str, engine: dict[str, Any], tmp: Path
) -> Callable[[str], list[dict[str, Any]]]:
    """The ranks' specs for a rendezvous at ``init``: the prompts dealt round-robin."""
    ids = random_prompts(args.num_prompts, args.input_len, args.seed)

    def spec(init: str, rank: int) -> dict[str, Any]:
        out = tmp / f"{label.replace(' ', '_')}-rank{rank}.json"
        mine = {f"p{i}": p for i, p in enumerate(ids) if i % world == rank}
        shared = dict(world=world, init=init, label=label, model=str(model), engine=engine)
        timing = dict(progress_every=args.progress_every, dist_timeout=args.dist_timeout)
        return dict(rank=rank, prompts=mine, max_tokens=args.output_len, out=str(out), **shared, **timing)

    def specs(init: str) -> list[dict[str, Any]]:
        return [spec(init, rank) for rank in range(world)]

    return specs


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def at(series: list[float] | None, steps: list[int]) -> list[float]:
    """The values of a per-step series at the 1-based ``steps`` (none without the series)."""
    return [series[i - 1] for i in steps] if series else []


def _median_ms(seconds: list[float]) -> float | None:
    return 1e3 * statistics.median(seconds) if seconds else None


def analyze(ranks: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """Pool step times (max over ranks per step) and the rebalance windows of rank 0's history
    (every rank swaps at the same step; checked)."""
    counts = {len(r["step_seconds"]) for r in ranks}
    if len(counts) != 1:
        raise RuntimeError(f"ranks ran different step counts {sorted(counts)}")
    steps = [max(col) for col in zip(*(r["step_seconds"] for r in ranks), strict=True)]
    iters = [max(col) for col in zip(*(r["iteration_seconds"] for r in ranks), strict=True)]
    cpu = [max(col) for col in zip(*(r["cpu_seconds"] for r in ranks), strict=True)]
    n = len(steps)
    bal = [r["balancer_seconds"] for r in ranks]
    own = [max(col) for col in zip(*bal, strict=True)] if all(bal) else None  # balancer share, max over ranks
    events = ranks[0]["history"]
    swaps = [[e["swap_step"] for e in r["history"]] for r in ranks]
    if any(s != swaps[0] for s in swaps):
        raise RuntimeError(f"ranks swapped at different steps: {swaps}")
    budget = [max(col) for col in zip(*(r["budget_seconds"] for r in ranks), strict=True)] if own else None
    pieces = [max(col) for col in zip(*(r["piece_seconds"] for r in ranks), strict=True)] if own else None
    window: set[int] = set()  # 1-based step indices (the balancer's step count)
    swap: set[int] = set()
    freeing: set[int] = set()
    per_event = []
    for k, e in enumerate(events):
        end = e["swap_step"] if e["swap_step"] is not None else n + 1
        win = [i for i in range(e["step"], end) if i <= n]  # the decision, then staging
        window.update(win)
        if e["swap_step"] is not None:
            swap.add(e["swap_step"])
            freed = e["freed_step"] if e["freed_step"] is not None else n
            freeing.update(range(e["swap_step"] + 1, freed + 1))
        staged = win[1:]  # the boundaries that staged pieces
        win_times = [steps[i - 1] for i in win]
        win_cpu = [cpu[i - 1] for i in win]
        # CPU the ranks' other threads (gloo's) got during the window
        other_cpu = max(sum(r["other_cpu_seconds"][i - 1] for i in win) for r in ranks)
        # the stepping thread's states over the window's iterations, summed over ranks (seconds):
        # on a CPU, runnable waiting for a CPU (other processes had it), blocked (collectives)
        states = [0.0, 0.0, 0.0]
        for r in ranks:
            for i in win:
                on, wait = r["sched"][i - 1]
                states[0] += on
                states[1] += wait
                states[2] += max(0.0, r["iteration_seconds"][i - 1] - on - wait)
        per_rank = [r["history"][k] for r in ranks]
        per_event.append(
            {
                "stepping_thread_seconds_in_window": dict(
                    zip(("on_cpu", "waiting_for_cpu", "blocked"), states, strict=True)
                ),
                "decision_step": e["step"],
                "swap_step": e["swap_step"],
                "freed_step": e["freed_step"],
                "steps_staging": len(win),
                "stage_seconds": max(h["stage_seconds"] for h in per_rank)
                if e["swap_step"] is not None
                else None,  # still staging when the run ended
                # per rank, max over ranks: pieces, boundaries with pieces, seconds in pieces
                "stage_pieces": max(h["stage_pieces"] for h in per_rank),
                "stage_steps": max(h["stage_steps"] for h in per_rank),
                "stage_work_seconds": max(h["stage_work_seconds"] for h in per_rank),
                "balance_before": e["balance_before"],
                "balance_after": e["balance_after"],
                "window_max_ms": 1e3 * max(win_times) if win_times else None,
                "window_median_ms": _median_ms(win_times),
                "window_cpu_median_ms": _median_ms(win_cpu),
                "window_other_threads_cpu_seconds": other_cpu,
                "decision_step_ms": 1e3 * steps[e["step"] - 1],
                "swap_step_ms": 1e3 * steps[e["swap_step"] - 1] if e["swap_step"] is not None else None,
                # inside those steps, the balancer's own time (load all-reduce + placement + staging
                # plan; pieces + ready flag; swap), max over ranks
                "decision_balancer_ms": 1e3 * own[e["step"] - 1] if own else None,
                "staging_balancer_max_ms": 1e3 * max(at(own, staged), default=0.0) if own else None,
                "staging_balancer_median_ms": _median_ms(at(own, staged)),
                # of which in pieces (the rest: the ready-flag all-reduce, waiting for the slowest rank)
                "staging_pieces_median_ms": _median_ms(at(pieces, staged)),
                "staging_pieces_max_ms": 1e3 * max(at(pieces, staged), default=0.0) if pieces else None,
                "staging_budget_median_ms": _median_ms(at(budget, staged)),
                "swap_balancer_ms": 1e3 * own[e["swap_step"] - 1]
                if own and e["swap_step"] is not None
                else None,
                "freeing_max_ms": 1e3 * max(steps[i - 1] for i in range(e["swap_step"] + 1, freed + 1))
                if e["swap_step"] is not None and freed > e["swap_step"]
                else None,
            }
        )
    moving_idx = window | swap | freeing
    steady_idx = [i for i in range(warmup + 1, n + 1) if i not in moving_idx]
    steady = [steps[i - 1] for i in steady_idx]
    median = _median(steady)
    steady_cpu = _median([cpu[i - 1] for i in steady_idx])
    moving = [steps[i - 1] for i in sorted(moving_idx) if i > warmup]
    out: dict[str, Any] = {
        "steps": n,
        "steady_steps": len(steady),
        "median_ms": 1e3 * median if median else None,
        "steady_p90_ms": 1e3 * statistics.quantiles(steady, n=10)[-1] if len(steady) > 10 else None,
        "steady_max_ms": 1e3 * max(steady) if steady else None,
        "steady_max_over_median": _ratio(max(steady) if steady else None, median),
        "steady_cpu_median_ms": 1e3 * steady_cpu if steady_cpu is not None else None,
        "events": per_event,
        "window_max_ms": 1e3 * max(moving) if moving else None,
        "worst_window_ratio": None,
        "worst_swap_ratio": None,
        "worst_freeing_ratio": None,
        "first_step_ms": 1e3 * steps[0],
        "iteration_median_ms": 1e3 * statistics.median(iters[warmup:]) if n > warmup else None,
        "output_tokens": sum(sum(r["tokens"]) for r in ranks),
        "wall_seconds": max(r["wall_seconds"] for r in ranks),
        "load_seconds": max(r["load_seconds"] for r in ranks),
        "rebuild_all_experts_seconds": max(
            (r["rebuild_all_experts_seconds"] for r in ranks if r["rebuild_all_experts_seconds"] is not None),
            default=None,
        ),
        "expert_bytes_per_rank": ranks[0]["expert_bytes"],
        "slots_per_layer": ranks[0]["slots_per_layer"],
        "moe_layers": ranks[0]["moe_layers"],
        "step_ms": [round(1e3 * s, 3) for s in steps],
        "balancer_ms": [round(1e3 * s, 3) for s in own] if own else None,
        "cpu_ms": [round(1e3 * s, 3) for s in cpu],
        "other_threads_cpu_ms_per_rank": [[round(1e3 * s, 3) for s in r["other_cpu_seconds"]] for r in ranks],
        "step_ms_per_rank": [[round(1e3 * s, 3) for s in r["step_seconds"]] for r in ranks],
    }
    windows = [e["window_max_ms"] for e in per_event if e["window_max_ms"] is not None]
    swaps_ms = [e["swap_step_ms"] for e in per_event if e["swap_step_ms"] is not None]
    freeing_ms = [e["freeing_max_ms"] for e in per_event if e["freeing_max_ms"] is not None]
    if median:
        out["worst_freeing_ratio"] = max(freeing_ms) / out["median_ms"] if freeing_ms else None
        out["worst_window_ratio"] = max(windows) / out["median_ms"] if windows else None
        out["worst_swap_ratio"] = max(swaps_ms) / out["median_ms"] if swaps_ms else None
        out["max_moving_ratio"] = out["window_max_ms"] / out["median_ms"] if moving else None
        out["target_met"] = (max(moving) / median <= TARGET_RATIO) if moving else None
    return out


def _f(x: float | None, fmt: str = ".1f") -> str:
    return "n/a" if x is None else format(x, fmt)


VARIANTS = {"baseline": "no rebalancing", "rebalance": "rebalancing"}


def markdown(doc: dict[str, Any]) -> str:
    m, a = doc["machine"], doc["args"]
    budget = a.get("stage_budget")
    lines = [
        "# EPLB stall: step times while an online rebalance moves expert weights",
        "",
        f"- date: {doc['date']}",
        f"- machine: {m.get('cpu_model', '?')}, {m['online_cpus']} CPUs ({m.get('cores_per_socket', '?')} "
        f"cores/socket, {m.get('threads_per_core', '?')} thread/core), {m.get('mem_total_gib', '?')} GiB; "
        f"Python {m['python']}, torch {m.get('torch', '?')}",
        f"- load average (1/5/15 min) at start {' / '.join(f'{x:.2f}' for x in doc['load_avg_start'])}, "
        f"at end {' / '.join(f'{x:.2f}' for x in doc['load_avg_end'])} (other work shared the machine)",
        f"- commit: {doc['commit']}",
        f"- command: `{doc['command']}`",
        f"- workload: {a['num_prompts']} prompts x {a['input_len']} random tokens, {a['output_len']} out "
        f"(greedy, ignore_eos), dealt round-robin to the ranks; {a['dtype']}, dummy weights, "
        f"1 torch + 1 numba thread per rank, gloo",
        f"- rebalancing: eplb_interval {a['interval']}, eplb_min_gain 0 (rebalance whenever EPLB proposes a "
        f"different placement), {a['redundant']} redundant experts, eplb_stage_budget "
        f"{'the default' if budget is None else budget} (staging time per step boundary as a fraction of "
        f"the median step); median = steady steps (from step {a['warmup'] + 1}) outside the steps while "
        "weights move; pool step time = max over ranks",
        f"- target: every step while weights move (decision + staging window, swap step, freeing of the "
        f"replaced weights) <= {TARGET_RATIO:.1f}x median",
        "",
        "Models (the tiny preset with these changes):",
        "",
        "| config | hidden | moe_inter | routed experts (groups) | MoE layers | expert weights per rank |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, c in doc["configs"].items():
        mib = c.get("expert_mib_per_rank", {})
        lines.append(
            f"| {name} | {c['hidden_size']} | {c['moe_intermediate_size']} | {c['n_routed_experts']} "
            f"({c['n_group']}) | {c['num_hidden_layers'] - c.get('first_k_dense_replace', 1)} | "
            + ", ".join(f"EP{w}: {v:.0f} MiB" for w, v in mib.items())
            + " |"
        )
    lines += [
        "",
        "| EP | config | rep | run | median ms | steady max / median | rebalances | stage s (steps staging) "
        "| idle rebuild s | max step in windows ms (x median) | max swap step ms (x median) "
        "| max freeing step ms (x median) | target met |",
        "|---:|---|---:|---|---:|---:|---:|---|---:|---|---|---|---|",
    ]
    for r, variant, label, e in _runs(doc):
        stage = ", ".join(_stage(ev) for ev in e["events"]) or "-"
        windows = [ev["window_max_ms"] for ev in e["events"] if ev["window_max_ms"] is not None]
        swaps = [ev["swap_step_ms"] for ev in e["events"] if ev["swap_step_ms"] is not None]
        frees = [ev["freeing_max_ms"] for ev in e["events"] if ev["freeing_max_ms"] is not None]
        moving = variant != "baseline"
        lines.append(
            f"| {r['world']} | {r['config']} | {r['repeat']} | {label} | {_f(e['median_ms'])} | "
            f"{_f(e['steady_max_over_median'], '.2f')} | {len(e['events']) if moving else '-'} | {stage} | "
            f"{_f(e['rebuild_all_experts_seconds'], '.2f') if moving else '-'} | "
            + (
                f"{_f(max(windows, default=None))} ({_f(e['worst_window_ratio'], '.2f')}) | "
                f"{_f(max(swaps, default=None))} ({_f(e['worst_swap_ratio'], '.2f')}) | "
                f"{_f(max(frees, default=None))} ({_f(e.get('worst_freeing_ratio'), '.2f')}) | "
                f"{_yes(e.get('target_met'))} |"
                if moving
                else "- | - | - | - |"
            )
        )
    lines += [
        "",
        "Every rebalance (pool step times, ratios to the run's median; balancer ms = the balancer's own "
        "share of a step, max over ranks: load all-reduce + placement + staging plan at the decision, "
        "pieces + ready-flag all-reduce while staging, module swap at the swap; pieces ms = the time in "
        "pieces at one boundary, max over ranks; pieces, boundaries and piece seconds per rank, max over "
        "ranks):",
        "",
    ]
    rows = [
        (*_event_cells(r, ev), ev["freed_step"], f"{ev['balance_before']:.3f} -> {ev['balance_after']:.3f}",
         _f(ev["stage_seconds"], ".2f"), f"{ev['stage_pieces']} / {ev['stage_steps']} / {ev['stage_work_seconds']:.2f}",
         _f(ev["staging_budget_median_ms"]),
         f"{_f(ev.get('staging_pieces_median_ms'))} / {_f(ev.get('staging_pieces_max_ms'))}",
         f"{_f(ev['staging_balancer_median_ms'])} / {_f(ev['staging_balancer_max_ms'])}", _f(ev["window_median_ms"]),
         f"{_f(ev['window_max_ms'])} ({_f(_ratio(ev['window_max_ms'], e['median_ms']), '.2f')})",
         f"{_f(ev['decision_step_ms'])} ({_f(ev['decision_balancer_ms'])})",
         f"{_f(ev['swap_step_ms'])} ({_f(_ratio(ev['swap_step_ms'], e['median_ms']), '.2f')}) ({_f(ev['swap_balancer_ms'])})",
         f"{_f(ev['window_cpu_median_ms'])} / {_f(e['steady_cpu_median_ms'])}")
        for r, e, ev in _rebalances(doc)
    ]  # fmt: skip
    lines += table(REBALANCE_COLUMNS, rows, "rlrlrrrlrlrllrllll")
    lines += [
        "",
        "Where the stepping thread's time went during each staging window (kernel schedstat, summed "
        "over ranks: on a CPU / runnable but waiting for a CPU, i.e. other processes had it / blocked, "
        "in collectives waiting for the other rank):",
        "",
    ]
    states = [
        (*_event_cells(r, ev), f"{sum(t.values()):.1f}",
         f"{t['on_cpu']:.2f} / {t['waiting_for_cpu']:.2f} / {t['blocked']:.2f}", f"{ev['window_other_threads_cpu_seconds']:.2f}")
        for r, _, ev in _rebalances(doc)
        if (t := ev["stepping_thread_seconds_in_window"])
    ]  # fmt: skip
    lines += table(STATE_COLUMNS, states, "rlrlrrrlr")
    lines += [
        "",
        "Other figures per run:",
        "",
        "| EP | config | rep | run | steps | steady p90 ms | steady max ms | steady stepping-thread CPU ms "
        "| output tok/s | load s |",
        "|---:|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r, _, label, e in _runs(doc):
        lines.append(
            f"| {r['world']} | {r['config']} | {r['repeat']} | {label} | {e['steps']} | "
            f"{_f(e['steady_p90_ms'])} | {_f(e['steady_max_ms'])} | {_f(e['steady_cpu_median_ms'])} | "
            f"{e['output_tokens'] / e['wall_seconds']:.0f} | {e['load_seconds']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def _runs(doc: dict[str, Any]) -> Iterator[tuple[dict[str, Any], str, str, dict[str, Any]]]:
    """(result, variant, its label, its run) of every run of the document, in order."""
    for r in doc["results"]:
        for variant, label in VARIANTS.items():
            if (e := r.get(variant)) is not None:
                yield r, variant, label, e


def _rebalances(doc: dict[str, Any]) -> Iterator[tuple[dict[str, Any], dict[str, Any], dict[str, Any]]]:
    """(result, its rebalancing run, one of the run's rebalances) of every rebalance, in order."""
    for r in doc["results"]:
        for ev in (r.get("rebalance") or {}).get("events", []):
            yield r, r["rebalance"], ev


def _event_cells(r: dict[str, Any], ev: dict[str, Any]) -> tuple[Any, ...]:
    """The first cells of a rebalance's row: the pool, the run, the decision and swap steps."""
    return r["world"], r["config"], r["repeat"], VARIANTS["rebalance"], ev["decision_step"], ev["swap_step"]


REBALANCE_COLUMNS = (
    "EP", "config", "rep", "run", "decision step", "swap step", "freed at", "balance before -> after", "stage s",
    "pieces / boundaries / piece s", "budget ms (median)", "pieces ms per boundary, median / max",
    "balancer ms while staging, median / max", "window median ms", "window max ms (x)",
    "decision step ms (balancer ms)", "swap step ms (x) (balancer ms)", "stepping thread CPU ms, window / steady median",
)  # fmt: skip
STATE_COLUMNS = (
    "EP", "config", "rep", "run", "decision step", "swap step", "window s x ranks", "on CPU / waiting / blocked s",
    "other threads' CPU s",
)  # fmt: skip


def _stage(ev: dict[str, Any]) -> str:
    if ev["stage_seconds"] is None:
        return f"unfinished at the end ({ev['steps_staging']})"
    return f"{ev['stage_seconds']:.2f} ({ev['steps_staging']})"


def _yes(x: bool | None) -> str:
    return "n/a" if x is None else "yes" if x else "**no**"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank-child", metavar="SPEC", help=argparse.SUPPRESS)
    parser.add_argument(
        "--pools",
        default="2:standard,2:slow-staging",
        help=f"comma-separated EP:CONFIG[:REPEATS] (EP 2 or 4; CONFIG: {', '.join(CONFIGS)}); each repeat "
        "runs every variant once",
    )
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--interval", type=int, default=96, help="eplb_interval (steps)")
    parser.add_argument("--redundant", type=int, default=4, help="num_redundant_experts")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--warmup", type=int, default=8, help="steps left out of the statistics")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--stage-budget",
        type=float,
        default=None,
        help="eplb_stage_budget: staging time per step boundary as a fraction of the median step "
        "(default: the engine's)",
    )
    parser.add_argument("--variants", default=None, help="only these of baseline,rebalance (default: both)")
    parser.add_argument("--progress-every", type=int, default=50)
    parser.add_argument("--run-timeout", type=float, default=900, help="seconds for one pool run")
    parser.add_argument("--dist-timeout", type=float, default=120, help="gloo collective timeout (s)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/eplb_stall.json")
    parser.add_argument("--markdown", type=Path, default=REPO / "benchmarks/results/eplb_stall.md")
    args = parser.parse_args(argv)
    if args.rank_child:
        return rank_main(json.loads(args.rank_child))

    exit_on_sigterm()
    pools: list[tuple[int, str, int]] = []
    for item in args.pools.split(","):
        parts = item.strip().split(":")
        if len(parts) not in (2, 3) or parts[1] not in CONFIGS:
            parser.error(
                f"--pools entry {item!r}: want EP:CONFIG[:REPEATS], CONFIG one of {', '.join(CONFIGS)}"
            )
        world, repeats = int(parts[0]), int(parts[2]) if len(parts) == 3 else 1
        experts = CONFIGS[parts[1]]["n_routed_experts"]
        if world < 2 or (experts + args.redundant) % world:
            parser.error(
                f"--pools entry {item!r}: {experts} experts + {args.redundant} redundant over {world} ranks"
            )
        pools.append((world, parts[1], repeats))
    doc: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_info(torch=True),
        "commit": git_commit(short=True),
        "command": "python " + " ".join([os.path.relpath(__file__, REPO), *sys.argv[1:]]),
        "load_avg_start": list(os.getloadavg()),
        "args": {
            k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "rank_child"
        },
        "target_ratio": TARGET_RATIO,
        "configs": {},
        "results": [],
    }
    rebalance: dict[str, Any] = {"eplb_interval": args.interval, "eplb_min_gain": 0.0}
    if args.stage_budget is not None:
        rebalance["eplb_stage_budget"] = args.stage_budget
    variants: list[tuple[str, dict[str, Any]]] = [
        ("baseline", {"eplb_interval": 0}),
        ("rebalance", rebalance),
    ]
    if args.variants:
        variants = [v for v in variants if v[0] in args.variants.split(",")]
    with tempfile.TemporaryDirectory(prefix="eplb-stall-") as tmp_name:
        tmp = Path(tmp_name)
        models: dict[str, tuple[Path, dict[str, Any]]] = {}
        for world, config_name, repeats in pools:
            if config_name not in models:
                models[config_name] = grown_preset(CONFIGS[config_name], tmp / "models" / config_name)
                doc["configs"][config_name] = {
                    k: models[config_name][1][k] for k in (*CONFIGS[config_name], "first_k_dense_replace")
                }
            model = models[config_name][0]
            base = {
                "load_format": "dummy",
                "dtype": args.dtype,
                "device": "cpu",
                "seed": args.seed,
                "kv_cache_memory": "256MiB",
                "max_num_seqs": args.num_prompts,
                "num_redundant_experts": args.redundant,
            }
            for repeat in range(1, repeats + 1):
                entry: dict[str, Any] = {"world": world, "config": config_name, "repeat": repeat}
                for variant, extra in variants:
                    label = f"EP{world} {config_name} {variant} #{repeat}"
                    print(f"== {label}", flush=True)
                    t = time.monotonic()
                    specs = pool_specs(args, world, model, label, {**base, **extra}, tmp)
                    ranks = run_pool(Path(__file__).resolve(), specs, label, args.run_timeout)
                    r = entry[variant] = analyze(ranks, args.warmup)
                    print(
                        f"   {label}: {r['steps']} steps in {time.monotonic() - t:.0f} s, median "
                        f"{_f(r['median_ms'])} ms, steady max/median "
                        f"{_f(r['steady_max_over_median'], '.2f')}"
                        + "".join(
                            f"; rebalance at step {ev['decision_step']} swapped at {ev['swap_step']} "
                            f"(stage {_f(ev['stage_seconds'], '.2f')} s), window max "
                            f"{_f(ev['window_max_ms'])} ms, swap step {_f(ev['swap_step_ms'])} ms"
                            for ev in r["events"]
                        ),
                        flush=True,
                    )
                doc["configs"][config_name].setdefault("expert_mib_per_rank", {})[world] = (
                    next(iter(v for k, v in entry.items() if k in VARIANTS))["expert_bytes_per_rank"] / 2**20
                )
                doc["results"].append(entry)
    doc["load_avg_end"] = list(os.getloadavg())
    write_json(args.out, doc)
    plot_result(args.out)
    args.markdown.parent.mkdir(parents=True, exist_ok=True)
    args.markdown.write_text(markdown(doc))
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
