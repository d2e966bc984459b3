"""Cluster performance model report (dsinfer/sim): predictions against DeepSeek's published H800
figures and SGLang's H100 reproduction, the gateway's balancers against round robin at EP32 and
EP144, and `dsinfer plan`'s day/night schedule for the published daily volume.

Nothing here is fitted to the figures it is compared with: the cost model's parameters are
datasheet values and published kernel-level measurements (dsinfer/sim/kernels.py), the traffic
is calibrated to the published request mix (configs/traffic/deepseek-v3-day-night.yaml), and
every other assumption is listed in the report.

    /work/venv/bin/python benchmarks/sim_report.py \\
        --out benchmarks/results/sim_report.json --markdown benchmarks/results/sim_report.md

About 10-20 minutes on 2 CPU cores (most of it in EP144 decode simulations); ``--quick`` runs
short windows and fewer budgets (a smoke test, numbers not of record); ``--from-json`` only
re-renders the markdown of a report already computed.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from dsinfer.cli.plan import load_pool_specs
from dsinfer.sim import kernels as K
from dsinfer.sim import planner
from dsinfer.sim.analytic import analytic_decode_speed
from dsinfer.sim.cache import SimCache
from dsinfer.sim.cost import decode_step, prefill_step
from dsinfer.sim.deployment import (
    Assumptions,
    PoolSpec,
    chunking_weights,
    kv_capacity_tokens,
    rank_shape,
)
from dsinfer.sim.hardware import H100, H800, with_measured
from dsinfer.sim.model_dims import ModelShape
from dsinfer.sim.simulator import Simulation
from dsinfer.sim.workload import DAY, TrafficProfile, mean_rate
from harness.plots import plot_result
from harness.provenance import REPO, git
from harness.results import write_json

TRAFFIC = REPO / "configs" / "traffic" / "deepseek-v3-day-night.yaml"
PROFILES = [
    str(REPO / "configs" / "profiles" / "deepseek-v3-h800-prefill-ep32.yaml"),
    str(REPO / "configs" / "profiles" / "deepseek-v3-h800-decode-ep144.yaml"),
]
# DeepSeek's deployment as published (DESIGN.md; the profiles run two micro-batches in both roles):
# the decode batch is whatever the SLO allows (max-num-seqs lifted), its KV cache what fits beside
# the weights.
OVERRIDES = ["decode.max-num-seqs=256"]
DECODE_KV = "42GiB"  # 80 GB - ~26 GB of weights - 10% reserve (dsinfer/sim/deployment.py)
# DeepSeek's published prefill profile (deepseek-ai/profile-data, assets/prefill.jpg): computation
# on 108 SMs, communication (DeepEP normal kernels) on 24.
DEEPSEEK_COMM_SMS = 24
# SGLang's conversion of a decode step with one MTP draft into tokens (lmsys.org large-scale-ep
# blog: "we conservatively assume a 60% acceptance rate under MTP"); its simulated-MTP figure
# (17,373 per node at 128 requests per GPU) and its 256-request step (22,282) agree with it.
SGLANG_MTP_TOKENS_PER_STEP = 1.6
# SGLang's prefill pool (lmsys.org large-scale-ep blog): EP32 on 4 nodes, 32 redundant experts,
# two-batch overlap, 16,384 tokens per GPU per step, no MTP; its 4K-prompt figure with its default
# routing (the same blog's profile section; 59,337 with simulated perfect EPLB)
SGLANG_PREFILL = PoolSpec("prefill", 32, 4, 32, overlap=True, mtp=False, max_num_batched_tokens=16384)
SGLANG_4K_DEFAULT = 50_302.0

PUBLISHED = {
    "deepseek_prefill_input_per_node": 73_700.0,
    "deepseek_decode_output_per_node": 14_800.0,
    "deepseek_mean_nodes": 226.75,
    "deepseek_peak_nodes": 278.0,
    "deepseek_daily_input": 608e9,
    "deepseek_daily_output": 168e9,
    "deepseek_profile_prefill_per_node": 62_713.0,  # SGLang's reading of DeepSeek's profile-data
    "deepseek_profile_decode_per_node": 18_598.0,
    "sglang_prefill_per_node": 52_300.0,  # headline, 2000-token inputs
    "sglang_prefill_per_node_2k_eval": 54_543.0,  # evaluation section, 2K prompts
    "sglang_prefill_per_node_4k_perfect_eplb": 59_337.0,  # 4K prompts, random (balanced) routing
    "sglang_decode_per_node": 22_300.0,  # 22,282: 256 requests/GPU, KV 2,000, EP72, no MTP
}
TOLERANCE = 0.15


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def rel(pred: float, ref: float) -> float:
    return pred / ref - 1.0


# Saturated steps (the setups measured at full batch) -------------------------------------------
def prefill_saturated(
    spec: PoolSpec, a: Assumptions, prompt: int, tokens_per_gpu: int, cache: SimCache
) -> dict[str, Any]:
    """Fresh prompts of ``prompt`` tokens filling ``tokens_per_gpu`` per rank every step."""
    pm = cache.pool_model(spec, a)
    ranks = spec.pool_size
    n = tokens_per_gpu / prompt
    rng = np.random.default_rng(a.seed)
    cost = prefill_step(
        pm,
        np.full(ranks, float(tokens_per_gpu)),
        np.full(ranks, float(tokens_per_gpu)),
        np.full(ranks, n * prompt * (prompt + 1) / 2),
        np.full(ranks, float(prompt)),
        np.full(ranks, n),
        rng,
    )
    gpn = spec.gpus_per_node
    return {
        "step_s": cost.time,
        "tokens_per_node": gpn * tokens_per_gpu / cost.time,
        "expert_imbalance": cost.expert_imbalance,
        "breakdown_ms": {k: v * 1e3 for k, v in cost.breakdown.items()},
    }


def decode_saturated(
    spec: PoolSpec,
    a: Assumptions,
    batch: int,
    context: float,
    cache: SimCache,
    tokens_per_step: float | None = None,
) -> dict[str, Any]:
    """Every rank running ``batch`` requests of ``context`` tokens; ``tokens_per_step`` per request
    (default 1 + the MTP acceptance with MTP, else 1)."""
    pm = cache.pool_model(spec, a)
    ranks = spec.pool_size
    cost = decode_step(
        pm, np.full(ranks, float(batch)), np.full(ranks, batch * context), np.random.default_rng(a.seed)
    )
    per_step = tokens_per_step or 1.0 + (a.mtp_acceptance if pm.mtp else 0.0)
    return {
        "step_s": cost.time,
        "tokens_per_step": per_step,
        "tokens_per_user_s": per_step / cost.time,
        "tokens_per_node": spec.gpus_per_node * batch * per_step / cost.time,
        "expert_imbalance": cost.expert_imbalance,
        "tail_ms": cost.tail * 1e3,
        "breakdown_ms": {k: v * 1e3 for k, v in cost.breakdown.items()},
    }


def decode_operating_point(
    spec: PoolSpec, a: Assumptions, speed: float, context: float, cache: SimCache
) -> dict[str, float]:
    """The largest batch whose analytic per-user speed is ``speed``, and its throughput."""
    lo, hi = 1.0, float(spec.max_num_seqs)
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if analytic_decode_speed(spec, a, mid, context, cache) >= speed else (lo, mid)
    v = analytic_decode_speed(spec, a, lo, context, cache)
    return {"batch": lo, "tokens_per_user_s": v, "tokens_per_node": spec.gpus_per_node * lo * v}


# Sections --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Study:
    """What every section simulates against: the traffic, DeepSeek's pools, the assumptions, the
    simulation window and the cache of pool models."""

    traffic: TrafficProfile
    specs: dict[str, PoolSpec]
    a: Assumptions
    window: planner.SimWindow
    cache: SimCache


def prefill_budgets(
    st: Study, spec: PoolSpec, budgets: list[int]
) -> tuple[list[dict[str, Any]], dict[int, planner.PoolCapacity]]:
    """The simulated capacity of one prefill pool at the SLO for each step budget."""
    rows, caps = [], {}
    for b in budgets:
        sb = replace(spec, max_num_batched_tokens=b)
        t0 = time.time()
        cap = planner.pool_capacity(st.traffic, sb, st.a, st.window, progress=log, cache=st.cache)
        caps[b] = cap
        rows.append(
            {
                "budget": b,
                "requests_per_s_per_pool": cap.rate,
                "input_tok_s_per_node": cap.tokens_per_node(sb),
                "analytic_input_tok_s_per_node": cap.analytic_rate * cap.tokens_per_request / sb.nnodes,
                "at_capacity": cap.result.summary() if cap.result else {},
                "probes": cap.probes,
                "seconds": time.time() - t0,
            }
        )
    return rows, caps


def best_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return max(rows, key=lambda r: (r["requests_per_s_per_pool"], r["budget"]))


def deepseek(st: Study, budgets: list[int]) -> dict[str, Any]:
    traffic, specs, a, window, cache = st.traffic, st.specs, st.a, st.window, st.cache
    lengths = cache.lengths(traffic)
    out: dict[str, Any] = {"traffic": asdict(lengths), "requests_per_s_mean": mean_rate(traffic, lengths)}
    pspec = specs["prefill"]
    rows, prefill_caps = prefill_budgets(st, pspec, budgets)
    out["prefill"] = {
        "spec": asdict(pspec),
        "budgets": rows,
        "best_budget": best_row(rows)["budget"],
        "daily_input_tok_s_per_node_implied": PUBLISHED["deepseek_daily_input"]
        / DAY
        / PUBLISHED["deepseek_prefill_input_per_node"],
    }
    t0 = time.time()
    dspec = specs["decode"]
    dcap = planner.pool_capacity(traffic, dspec, a, window, progress=log, cache=cache)
    out["decode"] = {
        "spec": asdict(dspec),
        "kv_tokens_per_rank": kv_capacity_tokens(dspec, a.hardware),
        "weights_gb_per_rank": rank_shape(ModelShape.preset(dspec.model), dspec).weights().total / 1e9,
        "requests_per_s_per_pool": dcap.rate,
        "output_tok_s_per_node": dcap.tokens_per_node(dspec),
        "analytic_output_tok_s_per_node": dcap.analytic_rate * dcap.tokens_per_request / dspec.nnodes,
        "at_capacity": dcap.result.summary() if dcap.result else {},
        "probes": dcap.probes,
        "seconds": time.time() - t0,
        "operating_points": {
            str(v): decode_operating_point(dspec, a, v, lengths.mean_decode_context, cache)
            for v in (20.0, 21.0, 22.0)
        },
        # the analytic step at the simulated capacity's mean batch (its parts: the tail after the main layers)
        "at_capacity_batch": decode_saturated(
            dspec,
            a,
            max(1, round(dcap.result.mean_batch)) if dcap.result else 1,
            lengths.mean_decode_context,
            cache,
        ),
    }
    shipped = load_pool_specs(PROFILES, [])["decode"]
    out["decode_shipped_profile"] = {
        "spec": asdict(shipped),
        "at_max_num_seqs": decode_saturated(
            replace(shipped, overlap=True), a, shipped.max_num_seqs, lengths.mean_decode_context, cache
        ),
    }
    # DeepSeek's profile-data settings: "we simulate an absolutely balanced MoE routing strategy for
    # profiling" (deepseek-ai/profile-data README), so uniform expert popularity; the main model's
    # layers (SGLang's per-node reading compares them with its non-MTP prefill)
    balanced = replace(a, expert_skew=0.0)
    pf = replace(pspec, max_num_batched_tokens=16384, mtp=False)
    # 256 experts on 128 GPUs: 2 each, no redundant slots (288 does not divide by 128)
    dprof = replace(dspec, pool_size=128, nnodes=16, num_redundant_experts=0)
    out["profile_data"] = {
        "prefill_ep32_16k_tokens_4k_prompts": prefill_saturated(pf, balanced, 4096, 16384, cache),
        "decode_ep128_128_requests_4k": decode_saturated(
            dprof, balanced, 128, 4096.0, cache, tokens_per_step=SGLANG_MTP_TOKENS_PER_STEP
        ),
        # the same two with this report's expert-popularity assumption (lognormal skew)
        "prefill_ep32_16k_tokens_4k_prompts_skewed": prefill_saturated(pf, a, 4096, 16384, cache),
        "decode_ep128_128_requests_4k_skewed": decode_saturated(
            dprof, a, 128, 4096.0, cache, tokens_per_step=SGLANG_MTP_TOKENS_PER_STEP
        ),
    }
    out["capacities"] = {"prefill": prefill_caps, "decode": dcap}
    return out


def sglang(a: Assumptions, cache: SimCache) -> dict[str, Any]:
    """SGLang's 96 x H100 setup (lmsys.org/blog/2025-05-05-large-scale-ep): prefill 4 nodes EP32 and
    decode 9 nodes EP72, 32 redundant experts with EPLB from in-distribution statistics, two-batch
    overlap on, DeepEP normal (prefill, DeepEP's default 20 SMs assumed) and low-latency (decode),
    DeepGEMM grouped contiguous (prefill) and masked (decode); prefill 16,384 tokens per GPU per
    step (two micro-batches of 8,192), no prefix cache; decode 256 requests per GPU over a
    2,000-token KV cache, no MTP; each phase measured alone at full load."""
    a100 = replace(a, hardware=H100)
    pre = SGLANG_PREFILL
    dec = PoolSpec("decode", 72, 9, 32, overlap=True, mtp=False, max_num_seqs=256)
    return {
        "prefill_2k": prefill_saturated(pre, a100, 2000, 16384, cache),
        "prefill_1k": prefill_saturated(pre, a100, 1000, 16384, cache),
        "prefill_4k": prefill_saturated(pre, a100, 4096, 16384, cache),
        # their "simulated perfect EPLB": random expert selection under group-limited routing
        "prefill_4k_balanced": prefill_saturated(pre, replace(a100, expert_skew=0.0), 4096, 16384, cache),
        "prefill_4k_no_overlap": prefill_saturated(replace(pre, overlap=False), a100, 4096, 16384, cache),
        "decode_256x2k": decode_saturated(dec, a100, 256, 2000.0, cache),
    }


def sglang_gap(a: Assumptions, ds: dict[str, Any], cache: SimCache) -> dict[str, Any]:
    """What SGLang's prefill gap would take: not a prediction. Two published measurements the model
    does not use: the in-situ compute efficiency DeepSeek's own profile implies (its profiled
    prefill step against the model's step for the same setup, both with balanced routing; a
    property of kernels under two-batch overlap, measured on H800 by DeepSeek, not by SGLang), and
    SGLang's own residual imbalance under its EPLB (its default routing against its simulated
    perfect EPLB, 4K prompts). The first is applied through ``Hardware.overlap_compute_efficiency``."""
    profile = ds["profile_data"]["prefill_ep32_16k_tokens_4k_prompts"]
    published_step = 8 * 16384 / PUBLISHED["deepseek_profile_prefill_per_node"]
    efficiency = min(1.0, profile["step_s"] / published_step)
    a_in_situ = replace(a, hardware=replace(H100, overlap_compute_efficiency=efficiency))
    residual = SGLANG_4K_DEFAULT / PUBLISHED["sglang_prefill_per_node_4k_perfect_eplb"]
    balanced = replace(a_in_situ, expert_skew=0.0)
    rows = {
        "prefill_2k": prefill_saturated(SGLANG_PREFILL, a_in_situ, 2000, 16384, cache)["tokens_per_node"],
        "prefill_4k": prefill_saturated(SGLANG_PREFILL, a_in_situ, 4096, 16384, cache)["tokens_per_node"],
        "prefill_4k_balanced": prefill_saturated(SGLANG_PREFILL, balanced, 4096, 16384, cache)[
            "tokens_per_node"
        ],
        "prefill_2k_balanced": prefill_saturated(SGLANG_PREFILL, balanced, 2000, 16384, cache)[
            "tokens_per_node"
        ],
    }
    return {"efficiency": efficiency, "residual_imbalance": residual, "tokens_per_node": rows}


def balancers(st: Study, prefill_rate: float, prefill_budget: int, decode_rate: float) -> dict[str, Any]:
    pre = replace(st.specs["prefill"], max_num_batched_tokens=prefill_budget)
    dec = st.specs["decode"]
    out: dict[str, Any] = {"prefill_rate": prefill_rate, "decode_rate": decode_rate}
    for name, kind, policy in (
        ("load+eplb", "load", "eplb"),
        ("round_robin+eplb", "round_robin", "eplb"),
        ("load+contiguous", "load", "contiguous"),
    ):
        aa = replace(st.a, balancer=kind, expert_policy=policy)
        log(f"balancers: {name}")
        w = st.window
        p = Simulation(st.traffic, pre, None, 1, 1, aa, st.cache).run(
            prefill_rate, w.prefill_duration, w.warmup
        )
        d = Simulation(st.traffic, None, dec, 1, 1, aa, st.cache).run(decode_rate, w.duration, w.warmup)
        out[name] = {
            "prefill_ep32": {"meets_slo": p.meets(st.traffic.slo), **p.summary()},
            "decode_ep144": {"meets_slo": d.meets(st.traffic.slo), **d.summary()},
        }
    return out


def sensitivity(
    specs: dict[str, PoolSpec], a: Assumptions, context: float, cache: SimCache
) -> dict[str, Any]:
    """How the analytic decode operating point and a full prefill step move with single assumptions."""
    dec, pre = specs["decode"], replace(specs["prefill"], max_num_batched_tokens=16384)
    cases = {
        "baseline": a,
        "expert_skew_0": replace(a, expert_skew=0.0),
        "expert_skew_1": replace(a, expert_skew=1.0),
        "mtp_acceptance_0.9": replace(a, mtp_acceptance=0.9),
        "mtp_acceptance_0.7": replace(a, mtp_acceptance=0.7),
        "no_expert_balancer": replace(a, expert_policy="contiguous"),
    }
    out = {}
    for name, aa in cases.items():
        out[name] = {
            "decode_at_21_tok_s": decode_operating_point(dec, aa, 21.0, context, cache),
            "prefill_16k_4k_prompts": prefill_saturated(pre, aa, 4096, 16384, cache)["tokens_per_node"],
        }
    out["no_overlap"] = {
        "decode_at_21_tok_s": decode_operating_point(replace(dec, overlap=False), a, 21.0, context, cache),
        "prefill_16k_4k_prompts": prefill_saturated(replace(pre, overlap=False), a, 4096, 16384, cache)[
            "tokens_per_node"
        ],
    }
    out["deepep_default_20_sms"] = {
        "decode_at_21_tok_s": decode_operating_point(dec, a, 21.0, context, cache),
        "prefill_16k_4k_prompts": prefill_saturated(replace(pre, comm_sms=20), a, 4096, 16384, cache)[
            "tokens_per_node"
        ],
    }
    return out


def chunking_sensitivity(st: Study, budgets: list[int]) -> dict[str, Any]:
    """Prefill capacity at the SLO without attention-aware chunking (token budget only, the engine
    scheduler's default) and with its attention weight halved and doubled."""
    spec = st.specs["prefill"]
    w = spec.attention_token_weight
    assert w is not None
    cases = {
        "tokens_only": (replace(spec, attention_token_weight=None, context_token_weight=0.0), budgets),
        "attention_weight_x0.5": (replace(spec, attention_token_weight=w / 2), budgets[:3]),
        "attention_weight_x2": (replace(spec, attention_token_weight=w * 2), budgets[:3]),
    }
    out = {}
    for name, (sp, bs) in cases.items():
        log(f"prefill chunking: {name}")
        rows, _ = prefill_budgets(st, sp, bs)
        out[name] = {"budgets": rows, "best": best_row(rows)}
    return out


def ttft_sensitivity(st: Study, budgets: list[int]) -> list[dict[str, Any]]:
    """Prefill capacity per node under other TTFT SLOs (the 2 s SLO is an assumption)."""
    rows = []
    for ttft in (1.0, 4.0):
        relaxed = st.traffic.model_copy(
            update={"slo": st.traffic.slo.model_copy(update={"ttft_p90_s": ttft})}
        )
        for b in budgets:
            spec = replace(st.specs["prefill"], max_num_batched_tokens=b)
            cap = planner.pool_capacity(relaxed, spec, st.a, st.window, progress=log, cache=st.cache)
            rows.append({"ttft_p90_s": ttft, "budget": b, "input_tok_s_per_node": cap.tokens_per_node(spec)})
    return rows


def the_plan(st: Study, budgets: list[int], caps: dict[str, Any], blocks: int) -> dict[str, Any]:
    traffic, specs = st.traffic, st.specs
    candidates = [replace(specs["prefill"], max_num_batched_tokens=b) for b in budgets]
    known = {"prefill": caps["prefill"], "decode": {specs["decode"].max_num_batched_tokens: caps["decode"]}}
    result = planner.plan(
        traffic, candidates, specs["decode"], st.a, blocks, st.window, True, log, known, st.cache
    )
    from dsinfer.cli.plan import format_plan, plan_to_dict

    data = plan_to_dict(result, traffic)
    nodes = result.mean_nodes(traffic)
    data["text"] = format_plan(result, traffic)
    data["daily_mean_tok_s_per_node"] = {
        "prefill_input": traffic.daily_input_tokens / DAY / nodes["prefill"],
        "decode_output": traffic.daily_output_tokens / DAY / nodes["decode"],
    }
    return data


# Markdown ------------------------------------------------------------------------------------
def _pct(pred: float, ref: float) -> str:
    return f"{rel(pred, ref):+.0%}"


def markdown(report: dict[str, Any]) -> str:
    ds, sg, pub = report["deepseek"], report["sglang"], PUBLISHED
    best = next(r for r in ds["prefill"]["budgets"] if r["budget"] == ds["prefill"]["best_budget"])
    L = ds["traffic"]
    plan = report["plan"]
    prof = ds["profile_data"]
    chunk = report["chunking_sensitivity"]
    daily = plan["daily_mean_tok_s_per_node"]
    lines = [
        "# Cluster performance model: predictions against published figures",
        "",
        f"Generated by `benchmarks/sim_report.py` on {report['meta']['date']} ({report['meta']['machine']}), "
        f"commit {report['meta']['commit']}, {report['meta']['seconds'] / 60:.0f} min. Hardware model: "
        f"{report['meta']['hardware']}; measured GPU ceilings: {report['meta']['measured_ceilings'] or 'none (no GPU measurements exist yet: datasheets and published kernel tables only)'}.",
        "",
        "## Predictions",
        "",
        "| figure | published | predicted | difference | within 15% |",
        "|---|---:|---:|---:|:---:|",
    ]

    def row(name: str, ref: float, pred: float) -> None:
        d = rel(pred, ref)
        lines.append(
            f"| {name} | {ref:,.0f} | {pred:,.0f} | {d:+.1%} | {'yes' if abs(d) <= TOLERANCE else 'no'} |"
        )

    row(
        "DeepSeek H800 prefill, input tok/s per node incl. cache hits, daily mean of the plan "
        "(the published figure's definition, see below)",
        pub["deepseek_prefill_input_per_node"],
        daily["prefill_input"],
    )
    row(
        "DeepSeek H800 decode, output tok/s per node, daily mean of the plan",
        pub["deepseek_decode_output_per_node"],
        daily["decode_output"],
    )
    row(
        f"DeepSeek H800 prefill capacity per node at TTFT p90 <= {report['slo']['ttft_p90_s']:g} s "
        f"(EP32, step budget {best['budget']}, a pool loaded to the SLO)",
        pub["deepseek_prefill_input_per_node"],
        best["input_tok_s_per_node"],
    )
    row(
        "DeepSeek H800 decode capacity per node at >= 20 tok/s per user (EP144, a pool loaded to the SLO)",
        pub["deepseek_decode_output_per_node"],
        ds["decode"]["output_tok_s_per_node"],
    )
    row(
        "Daily mean nodes of the plan for 608B in / 168B out",
        pub["deepseek_mean_nodes"],
        plan["mean_nodes"]["total"],
    )
    row("Peak nodes of the plan", pub["deepseek_peak_nodes"], plan["peak_nodes"])
    row(
        "SGLang H100 prefill, 2,000-token inputs (EP32, 16,384 tokens/GPU, their EPLB)",
        pub["sglang_prefill_per_node"],
        sg["prefill_2k"]["tokens_per_node"],
    )
    row(
        "SGLang H100 prefill, 4,096-token inputs, simulated perfect EPLB (balanced routing)",
        pub["sglang_prefill_per_node_4k_perfect_eplb"],
        sg["prefill_4k_balanced"]["tokens_per_node"],
    )
    row(
        "SGLang H100 decode, 256 requests/GPU, KV 2,000, no MTP (EP72)",
        pub["sglang_decode_per_node"],
        sg["decode_256x2k"]["tokens_per_node"],
    )
    row(
        "DeepSeek profile-data prefill (EP32, 16K tokens/GPU, 4K prompts, balanced routing; SGLang's reading)",
        pub["deepseek_profile_prefill_per_node"],
        prof["prefill_ep32_16k_tokens_4k_prompts"]["tokens_per_node"],
    )
    row(
        "DeepSeek profile-data decode (EP128, 128 requests/GPU, KV 4K, MTP, balanced routing; SGLang's "
        f"reading, {SGLANG_MTP_TOKENS_PER_STEP:g} tokens per step)",
        pub["deepseek_profile_decode_per_node"],
        prof["decode_ep128_128_requests_4k"]["tokens_per_node"],
    )
    cap = best["at_capacity"]
    dcap = ds["decode"]["at_capacity"]
    tok_only = chunk["tokens_only"]["best"]
    implied_p = pub["deepseek_daily_input"] / DAY / pub["deepseek_prefill_input_per_node"]
    implied_d = pub["deepseek_daily_output"] / DAY / pub["deepseek_decode_output_per_node"]
    util_p = daily["prefill_input"] / best["input_tok_s_per_node"]
    util_d = daily["decode_output"] / ds["decode"]["output_tok_s_per_node"]
    pf_step = prof["prefill_ep32_16k_tokens_4k_prompts"]["step_s"]
    pf_pub_step = 8 * 16384 / pub["deepseek_profile_prefill_per_node"]
    dp_step = prof["decode_ep128_128_requests_4k"]["step_s"]
    dp_pub_step = 8 * 128 * SGLANG_MTP_TOKENS_PER_STEP / pub["deepseek_profile_decode_per_node"]
    tbo_model = sg["prefill_4k"]["tokens_per_node"] / sg["prefill_4k_no_overlap"]["tokens_per_node"] - 1
    lines += [
        "",
        "Nothing in the model was fitted to these figures (see Assumptions); predictions outside 15% are",
        "reported as they came out. What the comparisons say:",
        "",
        "- **What DeepSeek's per-node figures are.** They are daily means over the nodes deployed: "
        f"608B input tokens / 86,400 s / 73.7k = {implied_p:.1f} prefill nodes and 168B / 86,400 s / 14.8k = "
        f"{implied_d:.1f} decode nodes, {implied_p + implied_d:.1f} in all, the published daily mean of 226.75 "
        "nodes. So the like-for-like prediction is the daily mean per node of a plan that sizes its pools "
        "block by block to the day/night curve (first two rows). A pool loaded to its SLO capacity all day "
        f"(rows three and four) does more per node; the plan's daily means are {util_p:.0%} (prefill) and "
        f"{util_d:.0%} (decode) of those capacities, as its blocks are sized to their peaks in whole pools. "
        "Input tokens include cache hits in both (a request's whole prompt counts when its prefill ends).",
        f"- **Kernel level, with the routing DeepSeek profiled.** DeepSeek's profile-data \"simulate[s] an "
        f"absolutely balanced MoE routing\"; with balanced routing the model's prefill step is "
        f"{pf_step:.2f} s against the {pf_pub_step:.2f} s the profile implies ({_pct(prof['prefill_ep32_16k_tokens_4k_prompts']['tokens_per_node'], pub['deepseek_profile_prefill_per_node'])} "
        f"throughput), and its decode step {dp_step * 1e3:.0f} ms against {dp_pub_step * 1e3:.0f} ms "
        f"({_pct(prof['decode_ep128_128_requests_4k']['tokens_per_node'], pub['deepseek_profile_decode_per_node'])}; "
        f"SGLang turned the profile into {pub['deepseek_profile_decode_per_node']:,.0f} tok/s per node with "
        f"{SGLANG_MTP_TOKENS_PER_STEP:g} tokens per step, so the same conversion is used). With this report's "
        "lognormal expert popularity instead, they would be "
        f"{_pct(prof['prefill_ep32_16k_tokens_4k_prompts_skewed']['tokens_per_node'], pub['deepseek_profile_prefill_per_node'])} and "
        f"{_pct(prof['decode_ep128_128_requests_4k_skewed']['tokens_per_node'], pub['deepseek_profile_decode_per_node'])} "
        "(EP128 has no redundant experts to balance with).",
        f"- **SGLang's prefill stays {_pct(sg['prefill_2k']['tokens_per_node'], pub['sglang_prefill_per_node'])} "
        "(2K prompts) and "
        f"{_pct(sg['prefill_4k_balanced']['tokens_per_node'], pub['sglang_prefill_per_node_4k_perfect_eplb'])} with "
        "balanced routing; its decode is "
        f"{_pct(sg['decode_256x2k']['tokens_per_node'], pub['sglang_decode_per_node'])}.** The setup is theirs "
        "(EP32, DeepEP normal kernels, DeepGEMM contiguous layout, two-batch overlap on, 16,384 tokens per GPU "
        "per step = two micro-batches of 8,192, no prefix cache). The model's rates are the kernels' own "
        "microbenchmarks and assume overlap costs nothing but the communication SMs; SGLang measured "
        "communication slower than DeepEP's unit tests whenever two-batch overlap was on, compute kernels "
        "slower under overlap than without it, and a two-batch-overlap gain of 27-35% at equal tokens per GPU "
        f"where the model predicts {tbo_model:.0%}. Those in-situ losses are not modelled (no GPU measurement exists here to "
        "size them) and are the likely rest of the prefill gap.",
        f"- **DeepSeek prefill at the TTFT SLO: attention-aware chunking removes the lockstep penalty.** Every "
        "rank of a pool steps together, and a continuation attends over its whole cached history (up to 64K "
        "tokens), so with a token-only step budget the slowest rank's attention stage is "
        f"{tok_only['at_capacity'].get('prefill_attention_imbalance', 0):.1f}x the mean and the best budget "
        f"({tok_only['budget']}) reaches {tok_only['input_tok_s_per_node']:,.0f} input tok/s per node at TTFT p90 "
        f"<= {report['slo']['ttft_p90_s']:g} s. DeepSeek's prefill load balancer balances core-attention "
        "computation across GPUs; a rank's scheduler can do the same per step by counting each chunk's "
        "attention and cached-context decompression against the step budget (a long-context continuation then "
        "gets a short chunk). With that policy (dsinfer.engine.scheduler, `attention_token_weight`; weights "
        "from the model's FLOPs, not tuned) the attention max/mean is "
        f"{cap.get('prefill_attention_imbalance', 0):.2f} and the capacity {best['input_tok_s_per_node']:,.0f} per "
        f"node (budget {best['budget']}); halving or doubling the attention weight gives "
        f"{chunk['attention_weight_x0.5']['best']['input_tok_s_per_node']:,.0f} / "
        f"{chunk['attention_weight_x2']['best']['input_tok_s_per_node']:,.0f}. Whether DeepSeek's engine "
        "composes steps this way is not published; the TTFT SLO is an assumption too (see the TTFT table).",
        f"- **DeepSeek decode.** The pool is KV-bound at {dcap.get('decode_batch_per_rank', 0):.0f} requests per "
        f"GPU, where users get {dcap.get('tokens_per_user_s', 0):.1f} tok/s (published: 20-22 on average); "
        f"the capacity is {_pct(ds['decode']['output_tok_s_per_node'], pub['deepseek_decode_output_per_node'])} "
        f"and the plan's daily mean {_pct(daily['decode_output'], pub['deepseek_decode_output_per_node'])} of the "
        "published 14.8k. The MTP layer is modelled after the main model's head (it drafts from the token just "
        f"verified): at that batch {ds['decode']['at_capacity_batch']['tail_ms']:.1f} ms of the "
        f"{ds['decode']['at_capacity_batch']['step_s'] * 1e3:.0f} ms step (analytic) are the two heads and "
        "that layer's own pipeline.",
        f"- **The plan's daily mean of {plan['mean_nodes']['total']:.0f} nodes against 226.75**: "
        f"{plan['mean_nodes']['prefill']:.0f} prefill nodes ({implied_p:.0f} implied by DeepSeek's figures) and "
        f"{plan['mean_nodes']['decode']:.0f} decode nodes ({implied_d:.0f} implied); peak {plan['peak_nodes']} "
        "against 278.",
        "",
        "## DeepSeek H800: prefill (EP32, 4 nodes) at the TTFT SLO",
        "",
        f"Traffic: {L['mean_prompt']:.0f} prompt tokens per request on average, {L['mean_new_tokens']:.0f} computed "
        f"(cache hits {L['cache_hit_fraction']:.1%}), {L['mean_output']:.0f} output tokens, mean context per "
        f"output token {L['mean_decode_context']:.0f}; {report['deepseek']['requests_per_s_mean']:.0f} requests/s on "
        f"average; {L['continuation_prob']:.1%} of requests continue a conversation.",
        "",
        f"Attention-aware chunking (attention weight {ds['prefill']['spec']['attention_token_weight']:,.0f} "
        f"query-key pairs per token, context weight {ds['prefill']['spec']['context_token_weight']:.3f}); the "
        "step budget is in new-token equivalents:",
        "",
        "| step budget | req/s per pool at SLO | input tok/s per node | TTFT p50 / p90 (s) | step (s) | attention max/mean | analytic, no imbalance |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def budget_rows(rows: list[dict[str, Any]]) -> None:
        for r in rows:
            c = r["at_capacity"]
            lines.append(
                f"| {r['budget']} | {r['requests_per_s_per_pool']:.1f} | {r['input_tok_s_per_node']:,.0f} | "
                f"{c.get('ttft_p50_s', 0):.2f} / {c.get('ttft_p90_s', 0):.2f} | {c.get('prefill_step_s', 0):.2f} | "
                f"{c.get('prefill_attention_imbalance', 0):.2f} | {r['analytic_input_tok_s_per_node']:,.0f} |"
            )

    budget_rows(ds["prefill"]["budgets"])
    lines += [
        "",
        "Token-only step budget (the engine scheduler's default; the previous revision of this report):",
        "",
        "| step budget | req/s per pool at SLO | input tok/s per node | TTFT p50 / p90 (s) | step (s) | attention max/mean | analytic, no imbalance |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    budget_rows(chunk["tokens_only"]["budgets"])
    lines += [
        "",
        "Attention weight halved and doubled (best budget shown):",
        "",
        "| attention weight | best budget | input tok/s per node | TTFT p90 (s) | attention max/mean |",
        "|---|---:|---:|---:|---:|",
    ]
    for name in ("attention_weight_x0.5", "attention_weight_x2"):
        r = chunk[name]["best"]
        c = r["at_capacity"]
        lines.append(
            f"| {name.split('_')[-1]} | {r['budget']} | {r['input_tok_s_per_node']:,.0f} | "
            f"{c.get('ttft_p90_s', 0):.2f} | {c.get('prefill_attention_imbalance', 0):.2f} |"
        )
    lines += [
        "",
        "Prefill capacity under other TTFT SLOs (simulated, attention-aware chunking):",
        "",
        "| TTFT p90 SLO | step budget | input tok/s per node |",
        "|---:|---:|---:|",
    ]
    for r in report["ttft_sensitivity"]:
        lines.append(f"| {r['ttft_p90_s']:g} s | {r['budget']} | {r['input_tok_s_per_node']:,.0f} |")
    dd = ds["decode"]
    c = dd["at_capacity"]
    lines += [
        "",
        "## DeepSeek H800: decode (EP144, 18 nodes) at >= 20 tok/s per user",
        "",
        f"Simulated capacity: {dd['requests_per_s_per_pool']:.0f} requests/s per pool = "
        f"{dd['output_tok_s_per_node']:,.0f} output tok/s per node, at {c.get('decode_batch_per_rank', 0):.0f} requests "
        f"per GPU, {c.get('tokens_per_user_s', 0):.1f} tok/s per user, step {c.get('decode_step_s', 0) * 1e3:.0f} ms, "
        f"attention max/mean {c.get('decode_attention_imbalance', 0):.3f}, expert max/mean "
        f"{c.get('decode_expert_imbalance', 0):.3f} (KV cache {dd['kv_tokens_per_rank']:,} tokens per GPU beside "
        f"{dd['weights_gb_per_rank']:.1f} GB of weights). Cost model without imbalance: "
        f"{dd['analytic_output_tok_s_per_node']:,.0f}.",
        "",
        "| per-user speed (analytic) | batch per GPU | output tok/s per node |",
        "|---:|---:|---:|",
    ]
    for v, op in dd["operating_points"].items():
        lines.append(f"| {float(v):.0f} tok/s | {op['batch']:.0f} | {op['tokens_per_node']:,.0f} |")
    sh = ds["decode_shipped_profile"]
    lines += [
        "",
        f"With the shipped decode profile (max-num-seqs {sh['spec']['max_num_seqs']}, KV "
        f"{sh['spec']['kv_cache_bytes'] / 2**30:.0f} GiB) a full batch runs at "
        f"{sh['at_max_num_seqs']['tokens_per_user_s']:.1f} tok/s per user: "
        f"{sh['at_max_num_seqs']['tokens_per_node']:,.0f} output tok/s per node (max-num-seqs binds before the SLO).",
        "",
        "## Kernel level: saturated steps against DeepSeek's profile and SGLang's measurements",
        "",
        "| case | setup | published per node | predicted per node | step | breakdown (ms, summed stage time) |",
        "|---|---|---:|---:|---:|---|",
    ]
    cases = (
        (
            prof["prefill_ep32_16k_tokens_4k_prompts"],
            "DeepSeek profile prefill",
            "H800 EP32, 16K tok/GPU, 4K prompts, balanced routing",
            pub["deepseek_profile_prefill_per_node"],
        ),
        (
            prof["prefill_ep32_16k_tokens_4k_prompts_skewed"],
            "the same, lognormal popularity",
            "skew 0.5, EPLB",
            pub["deepseek_profile_prefill_per_node"],
        ),
        (
            prof["decode_ep128_128_requests_4k"],
            "DeepSeek profile decode",
            f"H800 EP128, 128 req/GPU, KV 4K, MTP, balanced routing, {SGLANG_MTP_TOKENS_PER_STEP:g} tok/step",
            pub["deepseek_profile_decode_per_node"],
        ),
        (
            prof["decode_ep128_128_requests_4k_skewed"],
            "the same, lognormal popularity",
            "skew 0.5, no redundant experts",
            pub["deepseek_profile_decode_per_node"],
        ),
        (sg["prefill_1k"], "SGLang prefill 1K", "H100 EP32, 16,384 tok/GPU, 1K prompts", 57_674),
        (sg["prefill_2k"], "SGLang prefill 2K", "H100 EP32, 16,384 tok/GPU, 2K prompts", 54_543),
        (sg["prefill_4k"], "SGLang prefill 4K", "H100 EP32, 16,384 tok/GPU, 4K prompts", 50_302),
        (sg["prefill_4k_balanced"], "SGLang prefill 4K, perfect EPLB", "balanced routing", 59_337),
        (
            sg["prefill_4k_no_overlap"],
            "SGLang prefill 4K, no overlap",
            "one micro-batch, 16,384 tok/GPU",
            None,
        ),
        (sg["decode_256x2k"], "SGLang decode", "H100 EP72, 256 req/GPU, KV 2K, no MTP", 22_282),
    )
    for r, name, setup, ref in cases:
        bd = ", ".join(f"{k} {v:.0f}" for k, v in r["breakdown_ms"].items())
        refs = f"{ref:,.0f}" if ref else "-"
        step = f"{r['step_s'] * 1e3:.0f} ms"
        lines.append(f"| {name} | {setup} | {refs} | {r['tokens_per_node']:,.0f} | {step} | {bd} |")
    lines += sglang_gap_lines(report)
    b = report["balancers"]
    lines += [
        "",
        "## The seed's balancers against round robin at scale (simulated, DeepSeek traffic)",
        "",
        f"Prefill EP32 at {b['prefill_rate']:.1f} req/s per pool (the load balancer's capacity, attention-aware "
        f"chunking), decode EP144 at {b['decode_rate']:.0f} req/s per pool.",
        "",
        "| balancers | prefill TTFT p50 / p90 (s) | prefill attention max/mean | prefill expert max/mean | input tok/s per node | decode tok/s per user | decode attention max/mean | decode expert max/mean | decode step (ms) | meets SLO (P / D) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for name in ("load+eplb", "round_robin+eplb", "load+contiguous"):
        p, d = b[name]["prefill_ep32"], b[name]["decode_ep144"]
        lines.append(
            f"| {name} | {p['ttft_p50_s']:.2f} / {p['ttft_p90_s']:.2f} | {p['prefill_attention_imbalance']:.2f} | "
            f"{p['prefill_expert_imbalance']:.3f} | {p['input_tok_s_per_node']:,.0f} | {d['tokens_per_user_s']:.1f} | "
            f"{d['decode_attention_imbalance']:.3f} | {d['decode_expert_imbalance']:.3f} | {d['decode_step_s'] * 1e3:.0f} | "
            f"{'yes' if p['meets_slo'] else 'no'} / {'yes' if d['meets_slo'] else 'no'} |"
        )
    lines += [
        "",
        "`load` = the gateway's PrefillBalancer / DecodeBalancer, `round_robin` = RoundRobinBalancer, `eplb` = "
        "DeepSeek's EPLB placement with 32 redundant experts (dsinfer.parallel.eplb), `contiguous` = the default "
        "placement (no expert balancing).",
        "",
        "## The plan (`dsinfer plan`) for the published day",
        "",
        "```",
        plan["text"],
        "```",
        "",
        f"Daily mean per node: prefill {daily['prefill_input']:,.0f} input tok/s "
        f"(published 73,700), decode {daily['decode_output']:,.0f} output tok/s "
        f"(published 14,800). Every block was simulated with its pools (meets the SLO) and with one pool fewer of "
        f"each role (misses it): verified = {plan['verified']}. The same plan from the command line: "
        "`dsinfer plan --config configs/profiles/deepseek-v3-h800-prefill-ep32.yaml --config "
        "configs/profiles/deepseek-v3-h800-decode-ep144.yaml --traffic configs/traffic/deepseek-v3-day-night.yaml "
        "--set decode.max-num-seqs=256 "
        f"--set decode.kv-cache-memory={DECODE_KV} --attention-chunking` (the report also gives prefill "
        f"DeepSeek's {DEEPSEEK_COMM_SMS} communication SMs, which no serve flag sets).",
        "",
        "## Sensitivity (analytic cost model, one assumption changed)",
        "",
        "The prefill column is a full 16K-token step of 4K-token prompts with DeepSeek's pool settings "
        f"({DEEPSEEK_COMM_SMS} communication SMs, the MTP layer); `deepep_default_20_sms` changes only prefill.",
        "",
        "| case | decode batch at 21 tok/s | decode output tok/s per node | prefill 16K x 4K-prompt step, tok/s per node |",
        "|---|---:|---:|---:|",
    ]
    for name, s in report["sensitivity"].items():
        lines.append(
            f"| {name} | {s['decode_at_21_tok_s']['batch']:.0f} | {s['decode_at_21_tok_s']['tokens_per_node']:,.0f} | "
            f"{s['prefill_16k_4k_prompts']:,.0f} |"
        )
    lines += ["", "## Assumptions", ""]
    lines += [f"- {x}" for x in report["assumptions"]]
    return "\n".join(lines) + "\n"


def sglang_gap_lines(report: dict[str, Any]) -> list[str]:
    gap, pub = report.get("sglang_gap"), report["published"]
    if not gap:
        return []
    t, eff, res = gap["tokens_per_node"], gap["efficiency"], gap["residual_imbalance"]
    rows = (
        ("2K prompts (the headline)", t["prefill_2k"], None, pub["sglang_prefill_per_node"]),
        (
            "2K prompts, balanced routing x SGLang's residual",
            t["prefill_2k_balanced"],
            res,
            pub["sglang_prefill_per_node"],
        ),
        ("4K prompts, their EPLB", t["prefill_4k"], None, SGLANG_4K_DEFAULT),
        (
            "4K prompts, perfect EPLB",
            t["prefill_4k_balanced"],
            None,
            pub["sglang_prefill_per_node_4k_perfect_eplb"],
        ),
        (
            "4K prompts, balanced routing x SGLang's residual",
            t["prefill_4k_balanced"],
            res,
            SGLANG_4K_DEFAULT,
        ),
    )
    lines = [
        "",
        "## What the SGLang prefill gap would take (not a prediction)",
        "",
        "The model's prefill rates are unit-test rates; two published measurements it does not use "
        "would account for most of the SGLang gap. (1) DeepSeek's own profile (H800, balanced routing, "
        f"two-batch overlap) implies a step {1 / eff:.2f}x the model's: an in-situ compute efficiency of "
        f"{eff:.2f} (`Hardware.overlap_compute_efficiency`, 1.0 in every prediction above). (2) SGLang "
        f"measured its default routing under its EPLB at {SGLANG_4K_DEFAULT:,.0f} against "
        f"{pub['sglang_prefill_per_node_4k_perfect_eplb']:,.0f} with simulated perfect EPLB ({res:.3f}); the "
        "model's lognormal popularity with EPLB given the exact expected load loses ~1% instead. Using "
        "(1) would calibrate on DeepSeek's profile, and (2) is SGLang's own measurement of the setup being "
        "predicted, so neither enters the predictions. What would replace them: kernels timed under "
        "two-batch overlap on a Hopper GPU (written to `benchmarks/results/gpu_ceilings_<gpu>.json`) and "
        "DeepSeek-V3's real per-step routing statistics.",
        "",
        "| SGLang H100 prefill, EP32, 16,384 tok/GPU | published | with efficiency (1) | with (1) and (2) |",
        "|---|---:|---:|---:|",
    ]
    for name, tokens, factor, ref in rows:
        both = f"{tokens * factor:,.0f} ({_pct(tokens * factor, ref)})" if factor else "-"
        lines.append(f"| {name} | {ref:,.0f} | {tokens:,.0f} ({_pct(tokens, ref)}) | {both} |")
    return lines


def assumptions_list(a: Assumptions, traffic: TrafficProfile, specs: dict[str, PoolSpec]) -> list[str]:
    hw = a.hardware
    return [
        f"Hardware ({hw.name}): {hw.fp8_tflops:g} TFLOP/s dense FP8, {hw.bf16_tflops:g} dense BF16, "
        f"{hw.hbm_bandwidth / 1e12:.2f} TB/s HBM, {hw.nvlink_bandwidth / 1e9:.0f} GB/s NVLink, "
        f"{hw.nic_bandwidth * 8 / 1e9:.0f} Gb/s NIC per GPU, {hw.gpus_per_node} GPUs per node, {hw.sms} SMs "
        "(NVIDIA datasheets; H800 = H100 SXM with 400 GB/s NVLink). H100: the same with 900 GB/s NVLink.",
        "GEMMs: DeepGEMM's published H800 table (FP8, 1x128/128x128 scales; dense at M = 64/128/4096, grouped "
        "contiguous at 4096-8192 rows per expert, grouped masked at 256-1024), time linear in M between measured "
        "M, weight bytes / the smallest M's measured bandwidth at M = 0, constant TFLOP/s above; unlisted shapes "
        "scaled by N*K from the nearest listed one; BF16 GEMMs (absorbed W_UK/W_UV, router, LM head) at twice "
        "the FP8 time. Achieved fractions of the 1979 TFLOP/s peak this implies: 52-69% at M = 4096, 10-17% at M = 64.",
        f"MLA decode: FlashMLA's published H800 figures, max(latent bytes / {K.STREAM_BANDWIDTH / 1e9:.0f} GB/s, "
        f"FLOPs / {K.FLASHMLA_TFLOPS:.0f} TFLOP/s) (BF16 cache, 576-wide keys, 512-wide values, 128 heads).",
        "MLA prefill: FlashAttention-3's measured BF16 H100 rate by key length (430-621 TFLOP/s at 0.5k-16k, "
        "pytorch/benchmark PR #2391) on the causal FLOP count of 128 heads x (192 + 128); kv_b decompresses "
        "every context token of a chunk (cached prefix included).",
        "DeepEP: V1 tables on H800 + CX7 (normal: 58/57 GB/s RDMA at EP32, logical bytes = one FP8 copy per "
        "destination node; low-latency: 39-48 GB/s at EP32-256, one copy per (token, expert) pair); FP8 dispatch "
        "7168 B + 56 fp32 scales, BF16 combine 14336 B; a transfer lasts the busiest rank's volume (sent or "
        "received) over that bandwidth; normal kernels hold SMs while they overlap prefill compute: "
        f"{DEEPSEEK_COMM_SMS} of 132 in DeepSeek's deployment (its published prefill profile: computation 108 SMs, "
        "communication 24; compute x 132/108), DeepEP's default 20 for SGLang (their tuned value is not "
        "published; compute x 132/112); low-latency kernels none. No fixed latency per normal-mode transfer "
        "(DeepEP publishes bandwidths only for it), no slowdown of either stream by the other beyond the SMs.",
        f"Small kernels (norms, RoPE, quantization, SiLU, permutes, residuals): bytes from the model's dims at "
        f"{K.STREAM_BANDWIDTH / 1e9:.0f} GB/s, at least {K.KERNEL_FLOOR_S * 1e6:.0f} us each (launch + ramp).",
        "Overlap: two micro-batches splitting each rank's work in halves; DeepSeek's published compute orders "
        "(prefill ATTN/SHARED/MLP, decode ATTN-0/ATTN-1/SHARED/MLP five-stage), transfers one at a time in issue "
        "order; lockstep: every stage lasts its slowest rank's time. Without overlap: one micro-batch, compute "
        "waits for every transfer.",
        f"MTP: one draft token, accepted with probability {a.mtp_acceptance} (DeepSeek-V3 report: 85-90%; "
        "DeepSeek does not publish whether or how production uses it, DESIGN.md assumes it does). Decode: the "
        "verify step runs 2 tokens per request through the main model, whose head samples; then the MTP layer "
        "(one more MoE layer and its 14336 -> 7168 projection, 1 token per request) drafts from the sampled "
        "token, as its own two-micro-batch pipeline after that head (its transfers cannot hide under other "
        "layers), then its head. Prefill (a pool of an MTP deployment): the MTP layer over the prompt, one more "
        "layer of the pipeline, so that decode has its KV. The profile-data prefill and SGLang's cases run "
        "without MTP, the profile-data decode with it.",
        f"Expert load: per-layer lognormal popularity, sigma {a.expert_skew}; EPLB given the expected load "
        "(perfect statistics; hierarchical at EP32 on 4 nodes, global at EP144); per-step Poisson routing noise "
        "in decode; fan-out from DeepSeek's group-limited routing (4 of 8 groups). Uniform popularity (sigma 0) "
        "where the measurement had balanced routing: DeepSeek's profile-data (\"we simulate an absolutely "
        'balanced MoE routing strategy for profiling") and SGLang\'s "simulated perfect EPLB".',
        "Prefill step composition: each rank takes its queue first come first served (chunked prefill) under "
        "a per-step budget that counts, for each chunk, its tokens plus its causal query-key pairs / "
        f"{specs['prefill'].attention_token_weight:,.0f} plus {specs['prefill'].context_token_weight:.3f} per "
        "cached token it decompresses (attention-aware chunking). Both weights are the model's FLOPs at the "
        "datasheet's BF16/FP8 rate ratio (pairs of core attention that cost one token's attention-stage GEMMs; "
        "kv_b per context token relative to them), not tuned; the planner picks the budget. The same rule is "
        "in dsinfer's engine scheduler as an optional policy (`Scheduler(attention_token_weight=..., "
        "context_token_weight=...)`, off by default, no serve flag yet; `dsinfer plan --attention-chunking` "
        "models it). DeepSeek publishes that its prefill load balancer balances core-attention computation "
        "and input tokens across GPUs, not how its ranks compose a step.",
        "Traffic: published input/output ratio (608/168), cache hit fraction 56.3% and mean context per output "
        "token 4,989 reproduced by a conversation model (continuations carry the previous turn's prompt + output "
        "as cached history); new input and output lognormal with sigma "
        f"{traffic.new_tokens.sigma} / {traffic.output.sigma} (assumed), prompts capped at {traffic.max_context} "
        "(the API's context window then); the on-disk cache is global (3FS) and its reads are hidden.",
        f"Day/night: rate = mean x (1 + A cos(2 pi (t - {traffic.day_night.peak_hour:g} h) / 24 h)), peak/trough "
        f"{traffic.day_night.peak_over_trough:g} (assumed; not published).",
        f"SLO: TTFT p90 <= {traffic.slo.ttft_p90_s:g} s (assumed; the SLO used in SGLang's H800 PD study), per-user "
        f"decode speed >= {traffic.slo.min_tokens_per_s:g} tok/s (published 20-22), decode queue not growing.",
        f"Pools: prefill EP{specs['prefill'].pool_size} on {specs['prefill'].nnodes} nodes, decode "
        f"EP{specs['decode'].pool_size} on {specs['decode'].nnodes} nodes, 32 redundant experts, two micro-batches "
        "(enable-overlap in the profiles in configs/profiles, as DESIGN.md describes DeepSeek's deployment); "
        f"decode KV cache {DECODE_KV} per GPU (what fits beside ~26 GB of weights with a 10% reserve of the 80 GB "
        "for activations, CUDA graphs and DeepEP's low-latency buffers; BF16 latent cache, 62 layers with the "
        "MTP layer's, 71 KB per token) and no max-num-seqs cap below the SLO's batch; a decode rank admits while "
        "5% of its KV pages stay free. DeepSeek publishes neither its KV budget nor its batch per GPU.",
        "Utilization: nothing is assumed; the simulator's per-pool capacity at the SLO is what the plan loads "
        "pools to, and the plan's daily mean per-node throughput shows the utilization the day/night blocks "
        "and whole pools leave (reported next to the capacity).",
        "Published figures: DeepSeek's per-node throughputs are daily means over deployed nodes (608B / 86,400 s "
        "/ 73.7k and 168B / 86,400 s / 14.8k add up to the published 226.75 daily mean nodes), compared with the "
        "plan's daily means; input tokens include cache hits. SGLang's reading of DeepSeek's profile-data: "
        "prefill 62,713 = 8 x 16,384 tokens per node per step; decode 18,598 = 8 x 128 requests x "
        f"{SGLANG_MTP_TOKENS_PER_STEP:g} tokens per step (their stated 60% MTP acceptance, which their own "
        "simulated-MTP figures follow), so the model's step is converted the same way. SGLang's prefill figures "
        "are per node with 16,384 tokens per GPU per step in two micro-batches of 8,192.",
        "Not modelled: CPU scheduling and Python overheads (assumed hidden), recompute cost of decode "
        "preemptions (counted), KV transfer beyond the last layer's (tail added to TTFT), 3FS read bandwidth, "
        "network congestion, failures.",
    ]


def deepseek_specs() -> dict[str, PoolSpec]:
    """DeepSeek's pools: the shipped H800 profiles with overlap on, the decode batch free and its KV
    what fits; prefill with the published profile's 24 communication SMs and attention-aware
    chunking at the model's FLOP-derived weights."""
    specs = load_pool_specs(PROFILES, [*OVERRIDES, f"decode.kv-cache-memory={DECODE_KV}"])
    w, c = chunking_weights(ModelShape.preset(specs["prefill"].model))
    specs["prefill"] = replace(
        specs["prefill"], comm_sms=DEEPSEEK_COMM_SMS, attention_token_weight=w, context_token_weight=c
    )
    return specs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results/sim_report.json")
    parser.add_argument("--markdown", default="benchmarks/results/sim_report.md")
    parser.add_argument("--quick", action="store_true", help="short windows, two budgets (smoke test)")
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--from-json", default=None, metavar="FILE", help="only re-render FILE's markdown")
    args = parser.parse_args()
    if args.from_json:
        Path(args.markdown).write_text(markdown(json.loads(Path(args.from_json).read_text())))
        return 0
    start = time.time()
    cache = SimCache()  # pool models and the traffic's calibration, shared by every section
    traffic = TrafficProfile.load(TRAFFIC)
    hw, measured = with_measured(H800, REPO / "benchmarks" / "results")
    a = Assumptions(hardware=hw)
    specs = deepseek_specs()
    if args.quick:
        window = planner.SimWindow(duration=8.0, warmup=4.0, prefill_duration=20.0)
        budgets = [8192, 4096]
    else:
        window = planner.SimWindow()
        budgets = [b.max_num_batched_tokens for b in planner.budget_candidates(specs["prefill"])]
    report: dict[str, Any] = {"slo": traffic.slo.model_dump(), "published": PUBLISHED}
    log("DeepSeek H800 capacities")
    st = Study(traffic, specs, a, window, cache)
    ds = deepseek(st, budgets)
    caps = ds.pop("capacities")
    report["deepseek"] = ds
    log("SGLang H100")
    report["sglang"] = sglang(a, cache)
    report["sglang_gap"] = sglang_gap(a, ds, cache)
    best = ds["prefill"]["best_budget"]
    report["balancers"] = balancers(st, caps["prefill"][best].rate, best, caps["decode"].rate)
    report["sensitivity"] = sensitivity(specs, a, cache.lengths(traffic).mean_decode_context, cache)
    report["chunking_sensitivity"] = chunking_sensitivity(st, budgets)
    log("prefill capacity under other TTFT SLOs")
    report["ttft_sensitivity"] = ttft_sensitivity(st, sorted(budgets)[-3:][::-1])
    log("plan")
    report["plan"] = the_plan(st, budgets, caps, args.blocks)
    report["assumptions"] = assumptions_list(a, traffic, specs)
    report["meta"] = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}",
        "commit": git("rev-parse", "--short", "HEAD") + " + working tree",
        "seconds": time.time() - start,
        "hardware": hw.name,
        "measured_ceilings": str(measured) if measured else None,
        "quick": args.quick,
        "window": asdict(window),
    }
    write_json(Path(args.out), report, default=float)
    plot_result(Path(args.out))
    Path(args.markdown).write_text(markdown(report))
    log(f"wrote {args.out} and {args.markdown} in {(time.time() - start) / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
