"""Expert-parallel load balance of the placement policies on skewed synthetic expert load.

For each model size (DeepSeek-V3: 58 MoE layers x 256 experts in 8 groups; the tiny preset: its
MoE layers x 16 experts in 4 groups), pool (EP32 + 32 redundant on 4 nodes of 8, EP144 + 32
redundant on 18 nodes of 8; tiny: EP4 + 4 on 2 nodes of 2, EP8 + 8 on 4 nodes of 2) and skew
(Zipf exponent s: per layer, the expert of popularity rank k gets load ~ 1 / k^s times a uniform
0.8..1.2 factor, popularity ranks shuffled per layer), it reports max / mean per-rank load (1.0 is
perfect; an expert's load is split evenly over its replicas) for:

- ``none``: no redundancy, contiguous blocks of experts per rank (as even as the sizes allow);
- ``round-robin``: the R hottest experts get one extra copy each; experts dealt to ranks
  round-robin, then the copies dealt round-robin to ranks with room that lack the expert
  (load-aware choice of copies, load-unaware packing);
- ``greedy``: ``ExpertPlacement.default(load=...)``;
- ``eplb-hier`` / ``eplb-global``: ``rebalance_experts`` as DeepSeek defines it (hierarchical only
  where the groups divide the nodes), reporting also how many (layer, rank) pairs host one
  expert twice;
- ``dsinfer-eplb``: ``placement_from_load`` (what ``dsinfer eplb`` writes: the policy DeepSeek's
  rule picks, at most one replica of an expert per rank); ``dsinfer-1node``: the same with
  ``num_nodes=1`` (``dsinfer eplb`` without ``--num-nodes``: one node, i.e. pool-wide balancing).

Beside the synthetic loads, the measured load of the built-in trained model (tiny-chat, the same
pools as tiny): the tokens its router sent to each expert while ``dsinfer serve`` answered the
held-out evaluation (``--measured-load``, the gateway's ``GET /expert_load`` file that
benchmarks/accuracy.py saves; one row per role).

    /work/venv/bin/python benchmarks/eplb_balance.py \
        --out benchmarks/results/eplb_balance.json --markdown benchmarks/results/eplb_balance.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from dsinfer.base.config import ModelConfig
from dsinfer.base.expert_load import read_expert_load
from dsinfer.base.presets import resolve_model
from dsinfer.parallel.eplb import placement_from_load, rebalance_experts
from dsinfer.parallel.placement import ExpertPlacement, moe_layer_ids
from harness.plots import plot_result

METHODS = ("none", "round-robin", "greedy", "eplb-hier", "eplb-global", "dsinfer-eplb", "dsinfer-1node")


@dataclass(frozen=True)
class Setup:
    model: str
    ranks: int
    redundant: int
    nodes: int


SETUPS = (
    Setup("deepseek-v3", 32, 32, 4),
    Setup("deepseek-v3", 144, 32, 18),
    Setup("tiny", 4, 4, 2),
    Setup("tiny", 8, 8, 4),
)
MEASURED_SETUPS = (Setup("tiny-chat", 4, 4, 2), Setup("tiny-chat", 8, 8, 4))
MEASURED_LOAD = Path(__file__).resolve().parent / "results" / "tiny_chat_expert_load.json"


def synthetic_load(layers: list[int], experts: int, s: float, seed: int) -> dict[int, list[float]]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for layer in layers:
        popularity = torch.randperm(experts, generator=gen).double() + 1
        noise = 0.8 + 0.4 * torch.rand(experts, generator=gen, dtype=torch.float64)
        out[layer] = (1e6 / popularity**s * noise).tolist()
    return out


def balance(ranks: list[list[int]], load: list[float]) -> float:
    """max / mean per-rank load of one layer; ``ranks``: the experts each rank hosts."""
    copies = [0] * len(load)
    for hosted in ranks:
        for e in hosted:
            copies[e] += 1
    per_rank = [sum(load[e] / copies[e] for e in hosted) for hosted in ranks]
    return max(per_rank) / (sum(per_rank) / len(per_rank))


def split(slots: list[int], num_ranks: int) -> list[list[int]]:
    per = len(slots) // num_ranks
    return [slots[r * per : (r + 1) * per] for r in range(num_ranks)]


def contiguous(experts: int, num_ranks: int) -> list[list[int]]:
    bounds = [experts * r // num_ranks for r in range(num_ranks + 1)]
    return [list(range(bounds[r], bounds[r + 1])) for r in range(num_ranks)]


def round_robin(load: list[float], num_ranks: int, redundant: int) -> list[list[int]]:
    experts = len(load)
    room = (experts + redundant) // num_ranks
    ranks: list[list[int]] = [list(range(r, experts, num_ranks)) for r in range(num_ranks)]
    copies: list[list[int]] = [[] for _ in range(num_ranks)]
    hottest = sorted(range(experts), key=lambda e: (-load[e], e))[:redundant]
    for k, e in enumerate(hottest):
        cyclic = [(k + i) % num_ranks for i in range(num_ranks)]
        free = [r for r in cyclic if len(ranks[r]) + len(copies[r]) < room]
        r = next((r for r in free if e not in ranks[r] + copies[r]), None)
        if r is None:  # every rank with room hosts e: trade with an earlier copy elsewhere
            r = free[0]
            r2, j = next(
                (r2, j)
                for r2 in cyclic
                for j, c in enumerate(copies[r2])
                if e not in ranks[r2] + copies[r2] and c not in ranks[r] + copies[r]
            )
            copies[r].append(copies[r2][j])
            copies[r2][j] = e
            continue
        copies[r].append(e)
    return [h + c for h, c in zip(ranks, copies, strict=True)]


def duplicates(ranks: list[list[int]]) -> int:
    return sum(len(set(h)) < len(h) for h in ranks)


def run_setup(
    setup: Setup, s: float | str, seed: int, measured: dict[int, list[float]] | None = None
) -> dict:
    """One row: the synthetic load of Zipf exponent ``s``, or ``measured`` (``s`` then labels it)."""
    config = ModelConfig.from_file(resolve_model(setup.model)[0] / "config.json")
    layers, experts, groups = moe_layer_ids(config), config.n_routed_experts, config.n_group
    load = measured if measured is not None else synthetic_load(layers, experts, float(s), seed)
    layers = [layer for layer in layers if layer in load]
    weight = torch.tensor([load[layer] for layer in layers], dtype=torch.float64)
    replicas = experts + setup.redundant
    per_layer: dict[str, list[list[list[int]]] | None] = {}
    seconds: dict[str, float] = {}

    def timed(name: str, fn: Callable[[], list[list[list[int]]]]) -> None:
        start = time.perf_counter()
        per_layer[name] = fn()
        seconds[name] = time.perf_counter() - start

    timed("none", lambda: [contiguous(experts, setup.ranks) for _ in layers])
    timed("round-robin", lambda: [round_robin(load[layer], setup.ranks, setup.redundant) for layer in layers])

    def greedy() -> list[list[list[int]]]:
        p = ExpertPlacement.default(layers, experts, setup.ranks, setup.redundant, load=load)
        return [split(list(p.layers[layer]), setup.ranks) for layer in layers]

    timed("greedy", greedy)

    def eplb(num_groups: int, num_nodes: int) -> list[list[list[int]]]:
        phy2log, _, _ = rebalance_experts(weight, replicas, num_groups, num_nodes, setup.ranks)
        return [split(row, setup.ranks) for row in phy2log.tolist()]

    if groups % setup.nodes == 0:
        timed("eplb-hier", lambda: eplb(groups, setup.nodes))
    else:
        per_layer["eplb-hier"] = None  # DeepSeek's rule picks the global policy here
    timed("eplb-global", lambda: eplb(1, 1))

    def dsinfer() -> list[list[list[int]]]:
        p = placement_from_load(load, experts, setup.ranks, setup.redundant, groups, setup.nodes)
        return [split(list(p.layers[layer]), setup.ranks) for layer in layers]

    timed("dsinfer-eplb", dsinfer)

    def dsinfer_one_node() -> list[list[list[int]]]:
        p = placement_from_load(load, experts, setup.ranks, setup.redundant, groups, 1)
        return [split(list(p.layers[layer]), setup.ranks) for layer in layers]

    timed("dsinfer-1node", dsinfer_one_node)
    results = {}
    for name in METHODS:
        placed = per_layer[name]
        if placed is None:
            results[name] = None
            continue
        ratios = [balance(ranks, load[layer]) for ranks, layer in zip(placed, layers, strict=True)]
        results[name] = {
            "mean": sum(ratios) / len(ratios),
            "worst": max(ratios),
            "dup_rank_layers": sum(duplicates(ranks) for ranks in placed),
            "seconds": seconds[name],
        }
    return {
        "model": setup.model,
        "layers": len(layers),
        "experts": experts,
        "groups": groups,
        "ranks": setup.ranks,
        "redundant": setup.redundant,
        "nodes": setup.nodes,
        "zipf_s": s,
        "seed": seed,
        "results": results,
    }


def machine() -> dict[str, str]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain"], capture_output=True, text=True, check=True
        ).stdout.strip()
        commit += " (uncommitted changes)" if dirty else ""
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return {
        "cpu": f"{cpu}, {os.cpu_count()} cores",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "commit": commit,
    }


def markdown(doc: dict) -> str:
    lines = [
        "# EPLB balance: max / mean per-rank expert load (1.000 is perfect)",
        "",
        f"- date: {doc['date']}",
        f"- machine: {doc['machine']['cpu']}; Python {doc['machine']['python']}, torch {doc['machine']['torch']}",
        f"- commit: {doc['machine']['commit']}",
        f"- command: `{doc['command']}`",
        "- load: synthetic Zipf-like per layer (expert of popularity rank k ~ 1/k^s x U(0.8, 1.2), "
        f"popularity shuffled per layer), seed {doc['seed']}; rows `measured`: tiny-chat's router on the "
        f"held-out evaluation through `dsinfer serve` ({doc.get('measured_load') or 'not run'})",
        "- each cell: mean over layers / worst layer; `dup` = (layer, rank) pairs hosting one expert twice "
        "(DeepSeek's packing allows it, ExpertPlacement does not)",
        "",
        "| model | EP + redundant (nodes) | s | " + " | ".join(METHODS) + " |",
        "|---|---|---:|" + "---:|" * len(METHODS),
    ]
    for row in doc["rows"]:
        cells = []
        for name in METHODS:
            r = row["results"][name]
            if r is None:
                cells.append("n/a")
                continue
            cell = f"{r['mean']:.3f} / {r['worst']:.3f}"
            if r["dup_rank_layers"]:
                cell += f" (dup {r['dup_rank_layers']})"
            cells.append(cell)
        label = f"EP{row['ranks']} + {row['redundant']} ({row['nodes']})"
        model = f"{row['model']} ({row['layers']}x{row['experts']}, {row['groups']} groups)"
        lines.append(f"| {model} | {label} | {row['zipf_s']} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Seconds to compute each placement (all layers), first skew:",
        "",
        "| model | EP + redundant | " + " | ".join(METHODS[1:]) + " |",
        "|---|---|" + "---:|" * (len(METHODS) - 1),
    ]
    first_s = doc["rows"][0]["zipf_s"]
    for row in doc["rows"]:
        if row["zipf_s"] != first_s:
            continue
        res = row["results"]
        cells = ["n/a" if res[m] is None else f"{res[m]['seconds']:.3f}" for m in METHODS[1:]]
        lines.append(
            f"| {row['model']} | EP{row['ranks']} + {row['redundant']} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--zipf", default="0.6,1.0", help="comma-separated Zipf exponents (default 0.6,1.0)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="results JSON")
    parser.add_argument("--markdown", type=Path, default=None, help="results table (Markdown)")
    parser.add_argument(
        "--measured-load", type=Path, default=MEASURED_LOAD, help="expert-load statistics file of tiny-chat"
    )
    args = parser.parse_args()
    rows = [run_setup(setup, float(s), args.seed) for setup in SETUPS for s in args.zipf.split(",")]
    measured_from = None
    if args.measured_load.is_file():
        measured_from = os.path.relpath(args.measured_load, Path(__file__).resolve().parent.parent)
        for role in ("prefill", "decode"):
            load = read_expert_load(args.measured_load, role)
            rows += [run_setup(setup, f"measured ({role})", args.seed, load) for setup in MEASURED_SETUPS]
    doc = {
        "benchmark": "eplb_balance",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(["python", *sys.argv]),
        "machine": machine(),
        "seed": args.seed,
        "measured_load": measured_from,
        "rows": rows,
    }
    table = markdown(doc)
    print(table)
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
        plot_result(args.out)
    if args.markdown:
        args.markdown.write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
