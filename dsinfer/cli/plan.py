"""``dsinfer plan``: prefill and decode pools for a traffic profile and its SLO, per block of the day.

``--config`` takes ``dsinfer serve`` deployment profiles (configs/profiles/*.yaml), one per role
(the file's ``role`` says which), validated by the serve parser; ``--set ROLE.KEY=VALUE`` changes
a key of one role's profile (a ``dsinfer serve`` flag name, e.g.
``--set decode.num-redundant-experts=32 --set decode.max-num-seqs=256``). ``--traffic`` is a
traffic profile (configs/traffic/*.yaml: daily volume, day/night curve, lengths, cache hits, SLO).
The planner (dsinfer/sim/planner.py) simulates each role, picks the prefill step token budget,
then checks every block of the day in the simulator with the planned pools and with one pool
fewer of each role.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from dsinfer.cli.errors import UsageError
from dsinfer.cli.plan_cache import measured_hit_fraction, plan_without_hits, saving_lines

PLAN_ROLES = ("prefill", "decode")


def add_plan_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        action="append",
        required=True,
        metavar="FILE",
        help="a `dsinfer serve` profile of a prefill or a decode pool (give one of each)",
    )
    parser.add_argument("--traffic", required=True, metavar="FILE", help="traffic profile (YAML)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="ROLE.KEY=VALUE",
        help="change one key of a role's profile, e.g. decode.num-redundant-experts=32",
    )
    parser.add_argument("--hardware", default="h800", help="h800, h100 or h200 (default h800)")
    parser.add_argument(
        "--blocks", type=int, default=6, help="equal blocks of the day with their own pool counts"
    )
    parser.add_argument(
        "--duration", type=float, default=30.0, help="simulated seconds measured per decode check"
    )
    parser.add_argument(
        "--prefill-duration", type=float, default=90.0, help="simulated seconds measured per prefill check"
    )
    parser.add_argument("--warmup", type=float, default=10.0, help="simulated seconds before measuring")
    parser.add_argument(
        "--prefill-budgets",
        default="auto",
        help="prefill step token budgets to choose from: 'auto' (the profile's and its halvings down "
        "to 1024) or a comma-separated list",
    )
    parser.add_argument(
        "--attention-chunking",
        action="store_true",
        help="prefill ranks chunk prompts by attention cost, not tokens alone (the engine scheduler's "
        "attention_token_weight policy, with the model's FLOP-derived weights; no serve flag sets it yet)",
    )
    parser.add_argument("--expert-skew", type=float, default=0.5, help="lognormal sigma of expert popularity")
    parser.add_argument(
        "--cache-hits",
        default=None,
        metavar="FRACTION|FILE[:SETTING]",
        help="the share of input tokens the KV cache serves, instead of the traffic profile's: a fraction, "
        "or a benchmarks/kv_replay.py result (its best dsinfer setting, or SETTING); also plans without "
        "hits and shows the nodes the cache saves",
    )
    parser.add_argument("--no-verify", dest="verify", action="store_false", help="skip the per-block checks")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the plan as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


# PoolSpec fields that are the `dsinfer serve` flags of their name
_SAME_NAMED_FLAGS = (
    "pool_size",
    "nnodes",
    "num_redundant_experts",
    "max_num_seqs",
    "max_num_batched_tokens",
    "overlap_min_tokens",
)


def _override_tokens(overrides: list[str]) -> dict[str, list[str]]:
    tokens: dict[str, list[str]] = {role: [] for role in PLAN_ROLES}
    for item in overrides:
        key, sep, raw = item.partition("=")
        role, dot, name = key.partition(".")
        if not sep or not dot or role not in PLAN_ROLES or not name:
            raise UsageError(f"--set {item!r}: expected ROLE.KEY=VALUE with ROLE prefill or decode")
        value = yaml.safe_load(raw) if raw else None
        flag = "--" + name.replace("_", "-")
        if value is True:
            tokens[role].append(flag)
        elif value is False or value is None:
            raise UsageError(f"--set {item!r}: a switch can only be turned on here (true)")
        else:
            tokens[role] += [flag, str(value)]
    return tokens


def load_pool_specs(configs: list[str], overrides: list[str]) -> dict[str, Any]:
    """Serve profiles (+ overrides) -> ``PoolSpec`` per role, through the serve parser."""
    from dsinfer.cli.serve import config_tokens, serve_parser
    from dsinfer.engine.args import parse_size
    from dsinfer.sim.deployment import PoolSpec

    extra = _override_tokens(overrides)
    specs: dict[str, PoolSpec] = {}
    for name in configs:
        path = Path(name)
        tokens = config_tokens(path)
        args = serve_parser(prog=str(path)).parse_args(tokens)
        role = args.role
        if role not in PLAN_ROLES:
            raise UsageError(f"{path}: role {role!r}; dsinfer plan takes prefill and decode profiles")
        if role in specs:
            raise UsageError(f"{path}: a second {role} profile")
        args = serve_parser(prog=str(path)).parse_args(tokens + extra[role])
        try:
            kv = parse_size(args.kv_cache_memory) if args.kv_cache_memory is not None else None
            specs[role] = PoolSpec(
                role=role,
                overlap=args.enable_overlap,
                mtp=args.speculative_mtp,
                kv_cache_bytes=kv,
                model=args.model or "deepseek-v3",
                **{name: getattr(args, name) for name in _SAME_NAMED_FLAGS},
            )
        except ValueError as e:
            raise UsageError(f"{path}: {e}") from None
    missing = [r for r in PLAN_ROLES if r not in specs]
    if missing:
        raise UsageError(f"no {' or '.join(missing)} profile among --config files")
    return specs


def run_plan(args: argparse.Namespace) -> int:
    from dsinfer.sim import planner
    from dsinfer.sim.deployment import Assumptions
    from dsinfer.sim.hardware import get_hardware
    from dsinfer.sim.workload import TrafficError, TrafficProfile

    if args.blocks < 1 or args.duration <= 0 or args.prefill_duration <= 0 or args.warmup < 0:
        raise UsageError("--blocks must be >= 1, --duration and --prefill-duration > 0, --warmup >= 0")
    try:
        hardware = get_hardware(args.hardware)
        traffic = TrafficProfile.load(args.traffic)
    except (ValueError, TrafficError) as e:
        raise UsageError(str(e)) from None
    specs = load_pool_specs(args.config, args.overrides)
    measured = measured_hit_fraction(args.cache_hits) if args.cache_hits is not None else None
    if measured is not None:
        traffic = traffic.model_copy(update={"cache_hit_fraction": measured[0]})
    from dataclasses import replace

    if args.attention_chunking:
        from dsinfer.sim.deployment import chunking_weights
        from dsinfer.sim.model_dims import ModelShape

        try:
            w, c = chunking_weights(ModelShape.preset(specs["prefill"].model))
        except ValueError as e:
            raise UsageError(f"--attention-chunking: {e}") from None
        specs["prefill"] = replace(specs["prefill"], attention_token_weight=w, context_token_weight=c)
    if args.prefill_budgets == "auto":
        prefill = planner.budget_candidates(specs["prefill"])
    else:
        try:
            budgets = [int(x) for x in args.prefill_budgets.split(",") if x.strip()]
        except ValueError:
            raise UsageError(
                f"--prefill-budgets {args.prefill_budgets!r}: expected 'auto' or integers"
            ) from None
        if not budgets or min(budgets) < 1:
            raise UsageError("--prefill-budgets needs positive integers")
        prefill = [replace(specs["prefill"], max_num_batched_tokens=b) for b in budgets]
    a = Assumptions(hardware=hardware, expert_skew=args.expert_skew)
    window = planner.SimWindow(args.duration, args.warmup, args.prefill_duration)

    def progress(line: str) -> None:
        if not args.quiet:
            print(line, file=sys.stderr, flush=True)

    result = planner.plan(traffic, prefill, specs["decode"], a, args.blocks, window, args.verify, progress)
    text = format_plan(result, traffic)
    without: dict[str, float] = {}
    if measured is not None:
        progress("planning again with no cache hits")
        cold = plan_without_hits(traffic)
        baseline = planner.plan(cold, prefill, specs["decode"], a, args.blocks, window, False, progress)
        without = baseline.mean_nodes(cold)
        text += "\n".join(saving_lines(result.mean_nodes(traffic), without, *measured))
    print(text)
    if args.json:
        data = plan_to_dict(result, traffic)
        if measured is not None:
            data["cache"] = {
                "hit_fraction": measured[0],
                "source": measured[1],
                "mean_nodes_without_hits": without,
            }
        Path(args.json).write_text(json.dumps(data, indent=2) + "\n")
    return 0 if not args.verify or result.verified() else 1


def plan_to_dict(result: Any, traffic: Any) -> dict[str, Any]:
    nodes = result.mean_nodes(traffic)
    cap = result.capacity
    return {
        "traffic": result.traffic,
        "prefill_pool": {
            "nodes": result.prefill.nnodes,
            "ranks": result.prefill.pool_size,
            "max_num_batched_tokens": result.prefill.max_num_batched_tokens,
            "attention_token_weight": result.prefill.attention_token_weight,
            "context_token_weight": result.prefill.context_token_weight,
        },
        "decode_pool": {"nodes": result.decode.nnodes, "ranks": result.decode.pool_size},
        "capacity": {
            role: {
                "requests_per_s_per_pool": c.rate,
                "analytic_requests_per_s_per_pool": c.analytic_rate,
                "tokens_per_s_per_node": c.tokens_per_node(
                    result.prefill if role == "prefill" else result.decode
                ),
                "at_capacity": c.result.summary() if c.result else {},
                "probes": c.probes,
            }
            for role, c in cap.items()
        },
        "prefill_budgets": {str(k): v.rate for k, v in result.prefill_candidates.items()},
        "blocks": [
            {
                "hours": [b.start_h, b.end_h],
                "peak_requests_per_s": b.peak_rate,
                "prefill_pools": b.prefill_pools,
                "decode_pools": b.decode_pools,
                "checks": {name: {"meets_slo": ok, **summary} for name, (ok, summary) in b.checks.items()},
            }
            for b in result.blocks
        ],
        "mean_nodes": nodes,
        "peak_nodes": result.peak_nodes(),
        "verified": result.verified(),
    }


def format_plan(result: Any, traffic: Any) -> str:
    p, d = result.prefill, result.decode
    cap = result.capacity
    lines = [
        f"plan for {result.traffic} (SLO: TTFT p90 <= {traffic.slo.ttft_p90_s:g} s, "
        f">= {traffic.slo.min_tokens_per_s:g} tok/s per user)",
        f"  prefill pool: {p.nnodes} nodes, EP{p.pool_size}, step budget {p.max_num_batched_tokens} "
        f"{'token-equivalents (attention-aware chunking)' if p.attention_token_weight else 'tokens'}/rank; "
        f"{cap['prefill'].rate:.1f} req/s per pool = {cap['prefill'].tokens_per_node(p) / 1e3:.1f}k input tok/s per node",
        f"  decode pool:  {d.nnodes} nodes, EP{d.pool_size}; {cap['decode'].rate:.1f} req/s per pool = "
        f"{cap['decode'].tokens_per_node(d) / 1e3:.1f}k output tok/s per node",
        "",
        "  hours        peak req/s  prefill pools  decode pools  nodes  checked",
    ]
    for b in result.blocks:
        checked = (
            ""
            if not b.checks
            else ("ok" if all(ok == (n == "plan") for n, (ok, _) in b.checks.items()) else "FAILED")
        )
        nodes = b.prefill_pools * p.nnodes + b.decode_pools * d.nnodes
        lines.append(
            f"  {b.start_h:05.2f}-{b.end_h:05.2f}  {b.peak_rate:10.1f}  {b.prefill_pools:13d}  {b.decode_pools:12d}"
            f"  {nodes:5d}  {checked}"
        )
    nodes = result.mean_nodes(traffic)
    lines += [
        "",
        f"  daily mean nodes: {nodes['total']:.1f} (prefill {nodes['prefill']:.1f}, decode {nodes['decode']:.1f}); "
        f"peak {result.peak_nodes()}",
    ]
    return "\n".join(lines)
