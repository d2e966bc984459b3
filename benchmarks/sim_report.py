"""Cluster performance model report (dsinfer/sim): predictions against DeepSeek's published H800
figures and SGLang's H100 reproduction, the gateway's balancers against round robin at EP32 and
EP144, and `dsinfer plan`'s day/night schedule for the published daily volume.

Nothing here is fitted to the figures it is compared with: the cost model's parameters are
datasheet values and published kernel-level measurements (dsinfer/sim/kernels.py), the traffic
is calibrated to the published request mix (configs/traffic/deepseek-v3-day-night.yaml), and
every other assumption is listed in the report.

    /work/venv/bin/python benchmarks/sim_report.py \\
        --out benchmarks/results/sim_report.json --markdown benchmarks/results/sim_report.md

About 30-60 minutes on 2 CPU cores (most of it in EP144 decode simulations); ``--quick`` runs
short windows and fewer budgets (a smoke test, numbers not of record).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np

from dsinfer.cli.plan import load_pool_specs
from dsinfer.sim import kernels as K
from dsinfer.sim import planner
from dsinfer.sim.cost import decode_step, prefill_step
from dsinfer.sim.deployment import (
    Assumptions,
    PoolSpec,
    kv_capacity_tokens,
    pool_model,
    weight_bytes_per_rank,
)
from dsinfer.sim.hardware import H100, H800, with_measured
from dsinfer.sim.shape import ModelShape
from dsinfer.sim.simulator import Simulation, analytic_decode_speed
from dsinfer.sim.workload import DAY, TrafficProfile, calibrate, mean_rate

ROOT = Path(__file__).resolve().parent.parent
TRAFFIC = ROOT / "configs" / "traffic" / "deepseek-v3-day-night.yaml"
PROFILES = [
    str(ROOT / "configs" / "profiles" / "deepseek-v3-h800-prefill-ep32.yaml"),
    str(ROOT / "configs" / "profiles" / "deepseek-v3-h800-decode-ep144.yaml"),
]
# DeepSeek's deployment as published (DESIGN.md): two micro-batches in both roles; the decode
# batch is whatever the SLO allows (max-num-seqs lifted), its KV cache what fits beside the weights.
OVERRIDES = ["prefill.enable-overlap=true", "decode.enable-overlap=true", "decode.max-num-seqs=256"]
DECODE_KV = "42GiB"  # 80 GB - ~26 GB of weights - 10% reserve (dsinfer/sim/deployment.py)

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
    "sglang_decode_per_node": 22_300.0,  # 22,282: 256 requests/GPU, KV 2,000, EP72, no MTP
}
TOLERANCE = 0.15


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def rel(pred: float, ref: float) -> float:
    return pred / ref - 1.0


# Saturated steps (the setups measured at full batch) -------------------------------------------
def prefill_saturated(spec: PoolSpec, a: Assumptions, prompt: int, tokens_per_gpu: int) -> dict[str, Any]:
    """Fresh prompts of ``prompt`` tokens filling ``tokens_per_gpu`` per rank every step."""
    pm = pool_model(spec, a)
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


def decode_saturated(spec: PoolSpec, a: Assumptions, batch: int, context: float) -> dict[str, Any]:
    pm = pool_model(spec, a)
    ranks = spec.pool_size
    cost = decode_step(
        pm, np.full(ranks, float(batch)), np.full(ranks, batch * context), np.random.default_rng(a.seed)
    )
    per_step = 1.0 + (a.mtp_acceptance if pm.mtp else 0.0)
    return {
        "step_s": cost.time,
        "tokens_per_user_s": per_step / cost.time,
        "tokens_per_node": spec.gpus_per_node * batch * per_step / cost.time,
        "expert_imbalance": cost.expert_imbalance,
        "breakdown_ms": {k: v * 1e3 for k, v in cost.breakdown.items()},
    }


def decode_operating_point(spec: PoolSpec, a: Assumptions, speed: float, context: float) -> dict[str, float]:
    """The largest batch whose analytic per-user speed is ``speed``, and its throughput."""
    lo, hi = 1.0, float(spec.max_num_seqs)
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if analytic_decode_speed(spec, a, mid, context) >= speed else (lo, mid)
    v = analytic_decode_speed(spec, a, lo, context)
    return {"batch": lo, "tokens_per_user_s": v, "tokens_per_node": spec.gpus_per_node * lo * v}


# Sections --------------------------------------------------------------------------------------
def deepseek(
    traffic: TrafficProfile,
    specs: dict[str, PoolSpec],
    a: Assumptions,
    window: planner.SimWindow,
    budgets: list[int],
) -> dict[str, Any]:
    lengths = calibrate(traffic)
    out: dict[str, Any] = {"traffic": asdict(lengths), "requests_per_s_mean": mean_rate(traffic)}
    prefill_caps: dict[int, planner.PoolCapacity] = {}
    rows = []
    for b in budgets:
        spec = replace(specs["prefill"], max_num_batched_tokens=b)
        t0 = time.time()
        cap = planner.pool_capacity(traffic, spec, a, window, progress=log)
        prefill_caps[b] = cap
        rows.append(
            {
                "budget": b,
                "requests_per_s_per_pool": cap.rate,
                "input_tok_s_per_node": cap.tokens_per_node(traffic, spec),
                "analytic_input_tok_s_per_node": cap.analytic_rate * lengths.mean_prompt / spec.nnodes,
                "at_capacity": cap.result.summary() if cap.result else {},
                "probes": cap.probes,
                "seconds": time.time() - t0,
            }
        )
    best = max(rows, key=lambda r: (r["requests_per_s_per_pool"], r["budget"]))
    out["prefill"] = {"budgets": rows, "best_budget": best["budget"]}
    t0 = time.time()
    dspec = specs["decode"]
    dcap = planner.pool_capacity(traffic, dspec, a, window, progress=log)
    out["decode"] = {
        "spec": asdict(dspec),
        "kv_tokens_per_rank": kv_capacity_tokens(dspec, a.hardware),
        "weights_gb_per_rank": weight_bytes_per_rank(ModelShape.preset(dspec.model), dspec) / 1e9,
        "requests_per_s_per_pool": dcap.rate,
        "output_tok_s_per_node": dcap.tokens_per_node(traffic, dspec),
        "analytic_output_tok_s_per_node": dcap.analytic_rate * lengths.mean_output / dspec.nnodes,
        "at_capacity": dcap.result.summary() if dcap.result else {},
        "probes": dcap.probes,
        "seconds": time.time() - t0,
        "operating_points": {
            str(v): decode_operating_point(dspec, a, v, lengths.mean_decode_context)
            for v in (20.0, 21.0, 22.0)
        },
    }
    shipped = load_pool_specs(PROFILES, [])["decode"]
    out["decode_shipped_profile"] = {
        "spec": asdict(shipped),
        "at_max_num_seqs": decode_saturated(
            replace(shipped, overlap=True), a, shipped.max_num_seqs, lengths.mean_decode_context
        ),
    }
    # DeepSeek's profile-data settings (SGLang's per-node reading of them)
    pf = replace(specs["prefill"], max_num_batched_tokens=16384)
    out["profile_data"] = {
        "prefill_ep32_16k_tokens_4k_prompts": prefill_saturated(pf, a, 4096, 16384),
        # 256 experts on 128 GPUs: 2 each, no redundant slots (288 does not divide by 128)
        "decode_ep128_128_requests_4k": decode_saturated(
            replace(dspec, pool_size=128, nnodes=16, num_redundant_experts=0), a, 128, 4096.0
        ),
        # the same with uniform expert popularity (a synthetic benchmark's routing)
        "decode_ep128_128_requests_4k_skew0": decode_saturated(
            replace(dspec, pool_size=128, nnodes=16, num_redundant_experts=0),
            replace(a, expert_skew=0.0),
            128,
            4096.0,
        ),
    }
    out["capacities"] = {"prefill": prefill_caps, "decode": dcap}
    return out


def sglang(a: Assumptions) -> dict[str, Any]:
    """SGLang's 96 x H100 setup (lmsys.org/blog/2025-05-05-large-scale-ep): prefill 4 nodes EP32 and
    decode 9 nodes EP72, 32 redundant experts with EPLB, two-batch overlap, DeepEP normal (prefill)
    and low-latency (decode), DeepGEMM; prefill 16,384 tokens per GPU; decode 256 requests per GPU
    over a 2,000-token KV cache, no MTP; each phase measured alone at full load."""
    a100 = replace(a, hardware=H100)
    pre = PoolSpec("prefill", 32, 4, 32, overlap=True, mtp=False, max_num_batched_tokens=16384)
    dec = PoolSpec("decode", 72, 9, 32, overlap=True, mtp=False, max_num_seqs=256)
    return {
        "prefill_2k": prefill_saturated(pre, a100, 2000, 16384),
        "prefill_1k": prefill_saturated(pre, a100, 1000, 16384),
        "prefill_4k": prefill_saturated(pre, a100, 4096, 16384),
        "decode_256x2k": decode_saturated(dec, a100, 256, 2000.0),
    }


def balancers(
    traffic: TrafficProfile,
    specs: dict[str, PoolSpec],
    a: Assumptions,
    window: planner.SimWindow,
    prefill_rate: float,
    prefill_budget: int,
    decode_rate: float,
) -> dict[str, Any]:
    pre = replace(specs["prefill"], max_num_batched_tokens=prefill_budget)
    dec = specs["decode"]
    out: dict[str, Any] = {"prefill_rate": prefill_rate, "decode_rate": decode_rate}
    for name, kind, policy in (
        ("load+eplb", "load", "eplb"),
        ("round_robin+eplb", "round_robin", "eplb"),
        ("load+contiguous", "load", "contiguous"),
    ):
        aa = replace(a, balancer=kind, expert_policy=policy)
        log(f"balancers: {name}")
        p = Simulation(traffic, pre, None, 1, 1, aa).run(prefill_rate, window.prefill_duration, window.warmup)
        d = Simulation(traffic, None, dec, 1, 1, aa).run(decode_rate, window.duration, window.warmup)
        out[name] = {
            "prefill_ep32": {"meets_slo": p.meets(traffic.slo), **p.summary()},
            "decode_ep144": {"meets_slo": d.meets(traffic.slo), **d.summary()},
        }
    return out


def sensitivity(specs: dict[str, PoolSpec], a: Assumptions, context: float) -> dict[str, Any]:
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
            "decode_at_21_tok_s": decode_operating_point(dec, aa, 21.0, context),
            "prefill_16k_4k_prompts": prefill_saturated(pre, aa, 4096, 16384)["tokens_per_node"],
        }
    out["no_overlap"] = {
        "decode_at_21_tok_s": decode_operating_point(replace(dec, overlap=False), a, 21.0, context),
        "prefill_16k_4k_prompts": prefill_saturated(replace(pre, overlap=False), a, 4096, 16384)[
            "tokens_per_node"
        ],
    }
    return out


def ttft_sensitivity(
    traffic: TrafficProfile,
    specs: dict[str, PoolSpec],
    a: Assumptions,
    window: planner.SimWindow,
    budgets: list[int],
) -> list[dict[str, Any]]:
    """Prefill capacity per node under looser TTFT SLOs (the 2 s SLO is an assumption)."""
    rows = []
    for ttft in (4.0, 8.0):
        relaxed = traffic.model_copy(update={"slo": traffic.slo.model_copy(update={"ttft_p90_s": ttft})})
        for b in budgets:
            spec = replace(specs["prefill"], max_num_batched_tokens=b)
            cap = planner.pool_capacity(relaxed, spec, a, window, progress=log)
            rows.append(
                {"ttft_p90_s": ttft, "budget": b, "input_tok_s_per_node": cap.tokens_per_node(traffic, spec)}
            )
    return rows


def the_plan(
    traffic: TrafficProfile,
    specs: dict[str, PoolSpec],
    a: Assumptions,
    window: planner.SimWindow,
    budgets: list[int],
    caps: dict[str, Any],
    blocks: int,
) -> dict[str, Any]:
    candidates = [replace(specs["prefill"], max_num_batched_tokens=b) for b in budgets]
    known = {"prefill": caps["prefill"], "decode": {specs["decode"].max_num_batched_tokens: caps["decode"]}}
    result = planner.plan(traffic, candidates, specs["decode"], a, blocks, window, True, log, known)
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
def markdown(report: dict[str, Any]) -> str:
    ds, sg, pub = report["deepseek"], report["sglang"], PUBLISHED
    best = next(r for r in ds["prefill"]["budgets"] if r["budget"] == ds["prefill"]["best_budget"])
    L = ds["traffic"]
    plan = report["plan"]
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
        f"DeepSeek H800 prefill, input tok/s per node incl. cache hits, at TTFT p90 <= "
        f"{report['slo']['ttft_p90_s']:g} s (EP32, step budget {best['budget']})",
        pub["deepseek_prefill_input_per_node"],
        best["input_tok_s_per_node"],
    )
    row(
        "DeepSeek H800 decode, output tok/s per node at >= 20 tok/s per user (EP144, simulated)",
        pub["deepseek_decode_output_per_node"],
        ds["decode"]["output_tok_s_per_node"],
    )
    row(
        "SGLang H100 prefill, 2,000-token inputs (EP32, 16,384 tokens/GPU)",
        pub["sglang_prefill_per_node"],
        sg["prefill_2k"]["tokens_per_node"],
    )
    row(
        "SGLang H100 decode, 256 requests/GPU, KV 2,000, no MTP (EP72)",
        pub["sglang_decode_per_node"],
        sg["decode_256x2k"]["tokens_per_node"],
    )
    row(
        "DeepSeek profile-data prefill (EP32, 16K tokens/GPU, 4K prompts; SGLang's reading)",
        pub["deepseek_profile_prefill_per_node"],
        ds["profile_data"]["prefill_ep32_16k_tokens_4k_prompts"]["tokens_per_node"],
    )
    row(
        "DeepSeek profile-data decode (EP128, 128 requests/GPU, KV 4K, MTP; SGLang's reading)",
        pub["deepseek_profile_decode_per_node"],
        ds["profile_data"]["decode_ep128_128_requests_4k"]["tokens_per_node"],
    )
    row(
        "the same with uniform expert popularity (skew 0)",
        pub["deepseek_profile_decode_per_node"],
        ds["profile_data"]["decode_ep128_128_requests_4k_skew0"]["tokens_per_node"],
    )
    row(
        "DeepSeek daily mean prefill input tok/s per node of the plan (day/night blocks, whole pools)",
        pub["deepseek_prefill_input_per_node"],
        plan["daily_mean_tok_s_per_node"]["prefill_input"],
    )
    row(
        "DeepSeek daily mean decode output tok/s per node of the plan",
        pub["deepseek_decode_output_per_node"],
        plan["daily_mean_tok_s_per_node"]["decode_output"],
    )
    row(
        "Daily mean nodes of the plan for 608B in / 168B out",
        pub["deepseek_mean_nodes"],
        plan["mean_nodes"]["total"],
    )
    row("Peak nodes of the plan", pub["deepseek_peak_nodes"], plan["peak_nodes"])
    pf = ds["profile_data"]["prefill_ep32_16k_tokens_4k_prompts"]["tokens_per_node"]
    cap = best["at_capacity"]
    dcap = ds["decode"]["at_capacity"]
    loose = {(r["ttft_p90_s"], r["budget"]): r["input_tok_s_per_node"] for r in report["ttft_sensitivity"]}
    lines += [
        "",
        "Nothing in the model was fitted to these figures (see Assumptions); predictions outside 15% are",
        "reported as they came out. What the comparisons say:",
        "",
        f"- **Kernel level, saturated batches: the model is optimistic for prefill.** On the setups measured at "
        f"full batch it predicts {rel(pf, pub['deepseek_profile_prefill_per_node']):+.0%} against DeepSeek's "
        f"profile-data prefill and {rel(sg['prefill_2k']['tokens_per_node'], pub['sglang_prefill_per_node_2k_eval']):+.0%} "
        f"against SGLang's measured 2K prefill, but {rel(sg['decode_256x2k']['tokens_per_node'], pub['sglang_decode_per_node']):+.0%} "
        "against SGLang's decode. Its rates are the kernels' own microbenchmarks (DeepGEMM, FA3, DeepEP unit tests); "
        "SGLang's profile found communication slower than DeepEP's unit tests and MoE GEMMs slower than DeepSeek's "
        "in situ, and reached DeepSeek's profile only with a perfectly balanced synthetic expert load. Those "
        "in-situ losses are not modelled (no GPU measurement exists here to calibrate them).",
        f"- **DeepSeek prefill at the TTFT SLO is {rel(best['input_tok_s_per_node'], pub['deepseek_prefill_input_per_node']):+.0%}: "
        "set by lockstep data-parallel attention, not by kernel speed.** Every rank of a pool steps together, so a "
        "step lasts as long as its slowest rank's chunk; with the conversation traffic (a continuation attends over "
        f"its whole cached history, up to 64K tokens) the slowest rank's attention is {cap.get('prefill_attention_imbalance', 0):.1f}x "
        f"the mean, and TTFT p90 <= {report['slo']['ttft_p90_s']:g} s holds only with small step budgets and far below "
        f"the balanced capacity ({best['analytic_input_tok_s_per_node']:,.0f} per node without imbalance). The TTFT "
        "SLO is an assumption (DeepSeek publishes none): at 8 s the 16K-token budget reaches "
        f"{loose.get((8.0, 16384), 0):,.0f} per node. A step composer that balances attention per step (not only "
        "tokens) is what the gateway's prefill balancer cannot do alone.",
        f"- **DeepSeek decode at the SLO is {rel(ds['decode']['output_tok_s_per_node'], pub['deepseek_decode_output_per_node']):+.0%}.** "
        f"The pool is KV-bound at {dcap.get('decode_batch_per_rank', 0):.0f} requests per GPU, where users get "
        f"{dcap.get('tokens_per_user_s', 0):.1f} tok/s (inside the published 20-22); the plan's daily mean, which "
        "includes day/night blocks and whole 18-node pools, is "
        f"{rel(plan['daily_mean_tok_s_per_node']['decode_output'], pub['deepseek_decode_output_per_node']):+.0%}. "
        "The remaining gap is of the size of the in-situ kernel losses above (SGLang's decode: "
        f"{rel(sg['decode_256x2k']['tokens_per_node'], pub['sglang_decode_per_node']):+.0%}).",
        f"- **The plan's daily mean of {plan['mean_nodes']['total']:.0f} nodes against 226.75** follows from the two: "
        f"{plan['mean_nodes']['prefill']:.0f} prefill nodes (DeepSeek's figures imply ~95) and "
        f"{plan['mean_nodes']['decode']:.0f} decode nodes (~131 implied).",
        "",
        "## DeepSeek H800: prefill (EP32, 4 nodes) at the TTFT SLO",
        "",
        f"Traffic: {L['mean_prompt']:.0f} prompt tokens per request on average, {L['mean_new_tokens']:.0f} computed "
        f"(cache hits {L['cache_hit_fraction']:.1%}), {L['mean_output']:.0f} output tokens, mean context per "
        f"output token {L['mean_decode_context']:.0f}; {report['deepseek']['requests_per_s_mean']:.0f} requests/s on "
        f"average; {L['continuation_prob']:.1%} of requests continue a conversation.",
        "",
        "| step token budget | req/s per pool at SLO | input tok/s per node | TTFT p50 / p90 (s) | step (s) | attention max/mean | analytic, no imbalance |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in ds["prefill"]["budgets"]:
        c = r["at_capacity"]
        lines.append(
            f"| {r['budget']} | {r['requests_per_s_per_pool']:.1f} | {r['input_tok_s_per_node']:,.0f} | "
            f"{c.get('ttft_p50_s', 0):.2f} / {c.get('ttft_p90_s', 0):.2f} | {c.get('prefill_step_s', 0):.2f} | "
            f"{c.get('prefill_attention_imbalance', 0):.2f} | {r['analytic_input_tok_s_per_node']:,.0f} |"
        )
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
        "## SGLang on H100 (96 GPUs), their setup",
        "",
        "| phase | setup | published per node | predicted per node | step | breakdown (ms, summed stage time) |",
        "|---|---|---:|---:|---:|---|",
    ]
    for key, setup, ref in (
        ("prefill_1k", "EP32, 16,384 tok/GPU, 1K prompts", 57_674),
        ("prefill_2k", "EP32, 16,384 tok/GPU, 2K prompts", 54_543),
        ("prefill_4k", "EP32, 16,384 tok/GPU, 4K prompts", 50_302),
        ("decode_256x2k", "EP72, 256 req/GPU, KV 2K, no MTP", 22_282),
    ):
        r = sg[key]
        bd = ", ".join(f"{k} {v:.0f}" for k, v in r["breakdown_ms"].items())
        lines.append(
            f"| {key} | {setup} | {ref:,} | {r['tokens_per_node']:,.0f} | {r['step_s'] * 1e3:.0f} ms | {bd} |"
        )
    b = report["balancers"]
    lines += [
        "",
        "## The seed's balancers against round robin at scale (simulated, DeepSeek traffic)",
        "",
        f"Prefill EP32 at {b['prefill_rate']:.1f} req/s per pool (the load balancer's capacity), decode EP144 at "
        f"{b['decode_rate']:.0f} req/s per pool.",
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
        f"Daily mean per node: prefill {plan['daily_mean_tok_s_per_node']['prefill_input']:,.0f} input tok/s "
        f"(published 73,700), decode {plan['daily_mean_tok_s_per_node']['decode_output']:,.0f} output tok/s "
        f"(published 14,800). Every block was simulated with its pools (meets the SLO) and with one pool fewer of "
        f"each role (misses it): verified = {plan['verified']}.",
        "",
        "## Sensitivity (analytic cost model, one assumption changed)",
        "",
        "| case | decode batch at 21 tok/s | decode output tok/s per node | prefill 16K x 4K-prompt step, tok/s per node |",
        "|---|---:|---:|---:|",
    ]
    for name, s in report["sensitivity"].items():
        lines.append(
            f"| {name} | {s['decode_at_21_tok_s']['batch']:.0f} | {s['decode_at_21_tok_s']['tokens_per_node']:,.0f} | "
            f"{s['prefill_16k_4k_prompts']:,.0f} |"
        )
    lines += [
        "",
        "Prefill capacity under looser TTFT SLOs (simulated):",
        "",
        "| TTFT p90 SLO | step token budget | input tok/s per node |",
        "|---:|---:|---:|",
    ]
    for r in report["ttft_sensitivity"]:
        lines.append(f"| {r['ttft_p90_s']:g} s | {r['budget']} | {r['input_tok_s_per_node']:,.0f} |")
    lines += ["", "## Assumptions", ""]
    lines += [f"- {x}" for x in report["assumptions"]]
    return "\n".join(lines) + "\n"


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
        "received) over that bandwidth; normal kernels hold 20 of 132 SMs (compute x 132/112 during prefill "
        "overlap), low-latency kernels none.",
        f"Small kernels (norms, RoPE, quantization, SiLU, permutes, residuals): bytes from the model's dims at "
        f"{K.STREAM_BANDWIDTH / 1e9:.0f} GB/s, at least {K.KERNEL_FLOOR_S * 1e6:.0f} us each (launch + ramp).",
        "Overlap: two micro-batches splitting each rank's work in halves; DeepSeek's published compute orders "
        "(prefill ATTN/SHARED/MLP, decode ATTN-0/ATTN-1/SHARED/MLP five-stage), transfers one at a time in issue "
        "order; lockstep: every stage lasts its slowest rank's time. Without overlap: one micro-batch, compute "
        "waits for every transfer.",
        f"MTP: one draft token, accepted with probability {a.mtp_acceptance} (DeepSeek-V3 report: 85-90%); the "
        "verify step runs 2 tokens per request, the MTP layer one more MoE layer on 1 token per request, two "
        "LM heads per step over all tokens (once per step, not per micro-batch).",
        f"Expert load: per-layer lognormal popularity, sigma {a.expert_skew}; EPLB given the expected load "
        "(perfect statistics; hierarchical at EP32 on 4 nodes, global at EP144); per-step Poisson routing noise "
        "in decode; fan-out from DeepSeek's group-limited routing (4 of 8 groups).",
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
        "(the profiles in configs/profiles with enable-overlap on, as DESIGN.md describes DeepSeek's deployment); "
        f"decode KV cache {DECODE_KV} per GPU (what fits beside ~26 GB of weights with a 10% reserve) and no "
        "max-num-seqs cap below the SLO's batch; a decode rank admits while 5% of its KV pages stay free.",
        "Utilization: nothing is assumed; the simulator's per-pool capacity at the SLO is what the plan loads "
        "pools to, and the plan's daily mean per-node throughput shows the utilization the day/night blocks "
        "and whole pools leave (reported next to the capacity).",
        "Not modelled: CPU scheduling and Python overheads (assumed hidden), recompute cost of decode "
        "preemptions (counted), KV transfer beyond the last layer's (tail added to TTFT), 3FS read bandwidth, "
        "network congestion, failures.",
    ]


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
    traffic = TrafficProfile.load(TRAFFIC)
    hw, measured = with_measured(H800, ROOT / "benchmarks" / "results")
    a = Assumptions(hardware=hw)
    specs = load_pool_specs(PROFILES, [*OVERRIDES, f"decode.kv-cache-memory={DECODE_KV}"])
    if args.quick:
        window = planner.SimWindow(duration=8.0, warmup=4.0, prefill_duration=20.0)
        budgets = [4096, 2048]
    else:
        window = planner.SimWindow()
        budgets = [b.max_num_batched_tokens for b in planner.budget_candidates(specs["prefill"])]
    report: dict[str, Any] = {"slo": traffic.slo.model_dump(), "published": PUBLISHED}
    log("DeepSeek H800 capacities")
    ds = deepseek(traffic, specs, a, window, budgets)
    caps = ds.pop("capacities")
    report["deepseek"] = ds
    log("SGLang H100")
    report["sglang"] = sglang(a)
    best = ds["prefill"]["best_budget"]
    report["balancers"] = balancers(
        traffic, specs, a, window, caps["prefill"][best].rate, best, caps["decode"].rate
    )
    report["sensitivity"] = sensitivity(specs, a, calibrate(traffic).mean_decode_context)
    log("prefill capacity under looser TTFT SLOs")
    report["ttft_sensitivity"] = ttft_sensitivity(traffic, specs, a, window, sorted({best, max(budgets)}))
    log("plan")
    report["plan"] = the_plan(traffic, specs, a, window, budgets, caps, args.blocks)
    report["assumptions"] = assumptions_list(a, traffic, specs)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    report["meta"] = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}",
        "commit": commit.stdout.strip() + " + working tree",
        "seconds": time.time() - start,
        "hardware": hw.name,
        "measured_ceilings": str(measured) if measured else None,
        "quick": args.quick,
        "window": asdict(window),
    }
    Path(args.out).write_text(json.dumps(report, indent=1, default=float) + "\n")
    Path(args.markdown).write_text(markdown(report))
    log(f"wrote {args.out} and {args.markdown} in {(time.time() - start) / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
