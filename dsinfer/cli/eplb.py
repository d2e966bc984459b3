"""``dsinfer eplb``: an expert placement file from expert-load statistics, offline.

The statistics file is the gateway's ``GET /expert_load`` (dsinfer/base/expert_load.py); the
model config gives the experts, groups and MoE layers (with every MTP layer, so the file also
serves ``--speculative-mtp``); layers missing from the statistics get uniform load. The result
loads with ``dsinfer serve --placement FILE`` on a pool of ``--pool-size`` ranks started with the
same ``--num-redundant-experts``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dsinfer.cli.errors import UsageError

ROLES = ("decode", "prefill")


def add_eplb_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--stats", required=True, metavar="FILE", help="expert load file (GET /expert_load)")
    parser.add_argument("--role", required=True, choices=ROLES, help="whose load to balance")
    parser.add_argument("--pool-size", type=int, required=True, help="ranks of the expert-parallel pool")
    parser.add_argument("--num-redundant-experts", type=int, required=True, help="extra slots per MoE layer")
    parser.add_argument(
        "--num-nodes",
        type=int,
        default=1,
        help="nodes of the pool: when n_group divides by it, each node keeps whole expert groups and "
        "their replicas (DeepSeek's hierarchical policy); default 1, pool-wide balancing",
    )
    parser.add_argument(
        "--model", default=None, help="checkpoint directory or preset name (default: tiny-chat)"
    )
    parser.add_argument(
        "-o", "--output", required=True, metavar="FILE", help="placement file to write (JSON)"
    )


def run_eplb(args: argparse.Namespace) -> int:
    from dsinfer.base.config import ModelConfig
    from dsinfer.base.expert_load import read_expert_load
    from dsinfer.base.presets import resolve_model
    from dsinfer.parallel.eplb import placement_from_load
    from dsinfer.parallel.placement import ExpertPlacement, moe_layer_ids

    for flag, value, least in (
        ("--pool-size", args.pool_size, 1),
        ("--num-redundant-experts", args.num_redundant_experts, 0),
        ("--num-nodes", args.num_nodes, 1),
    ):
        if value < least:
            raise UsageError(f"{flag} must be >= {least}, got {value}")
    path, _ = resolve_model(args.model)
    config = ModelConfig.from_file(path / "config.json")
    layers = moe_layer_ids(config, config.num_nextn_predict_layers)
    num_logical = config.n_routed_experts
    try:
        stats = read_expert_load(Path(args.stats), args.role)
    except ValueError as e:
        raise UsageError(str(e)) from None
    unknown = sorted(set(stats) - set(layers))
    if unknown:
        raise UsageError(f"{args.stats}: load for layer {unknown[0]}, not a MoE layer of the model ({path})")
    wrong = next((layer for layer, counts in stats.items() if len(counts) != num_logical), None)
    if wrong is not None:
        raise UsageError(
            f"{args.stats}: layer {wrong} has {len(stats[wrong])} expert loads, the model has {num_logical} experts"
        )
    load = {layer: stats.get(layer, [1.0] * num_logical) for layer in layers}
    try:
        placement = placement_from_load(
            load, num_logical, args.pool_size, args.num_redundant_experts, config.n_group, args.num_nodes
        )
        baseline = ExpertPlacement.default(layers, num_logical, args.pool_size, args.num_redundant_experts)
    except ValueError as e:
        raise UsageError(
            f"no placement of {num_logical} experts + {args.num_redundant_experts} redundant on "
            f"{args.pool_size} ranks, {args.num_nodes} node(s), {config.n_group} expert groups: {e}"
        ) from None
    out = Path(args.output)
    try:
        placement.save(out)
    except OSError as e:
        raise UsageError(f"{out}: cannot write the placement ({e.strerror or e})") from None
    measured = {layer: load[layer] for layer in stats} or load
    after, before = placement.stats(measured), baseline.stats(measured)
    print(
        f"wrote {out}: {len(layers)} MoE layers ({len(stats)} with load), {args.pool_size} ranks x "
        f"{placement.slots_per_rank} slots; max/mean rank load {after['balance']:.3f} "
        f"(worst layer {after['max_balance']:.3f}), default layout {before['balance']:.3f} "
        f"({before['max_balance']:.3f})"
    )
    return 0
