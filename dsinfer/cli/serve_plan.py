"""``dsinfer serve --dry-run``: the layout, expert placement and memory plan of a configuration,
as printed lines (the plan itself: :mod:`dsinfer.cli.memory_plan`)."""

from __future__ import annotations

import os
from collections import Counter
from typing import TYPE_CHECKING

import torch

from dsinfer.base.config import PAGE_SIZE
from dsinfer.cli.errors import UsageError
from dsinfer.cli.memory_plan import (
    DevicePlan,
    ModelPlan,
    RankMemory,
    check_fit,
    device_plan,
    fmt_bytes,
    model_plan,
    rank_memory,
)
from dsinfer.engine.args import EngineArgs
from dsinfer.engine.device import free_memory
from dsinfer.gateway.args import GatewayArgs
from dsinfer.parallel.placement import ExpertPlacement, moe_layer_ids
from dsinfer.workers.args import PoolArgs

if TYPE_CHECKING:
    from dsinfer.cli.layout import Layout


# What --dry-run prints ------------------------------------------------------------------------
def describe(plan: ModelPlan, mem: RankMemory, label: str, pool_size: int) -> list[str]:
    c = plan.config
    experts = f"{mem.shape.expert_slots} of {c.n_routed_experts} routed experts"
    slots = mem.shape.expert_slots * pool_size
    if slots > c.n_routed_experts:
        experts += f"; {slots} slots = {c.n_routed_experts} + {slots - c.n_routed_experts} redundant"
    lines = [f"  {label} (EP{pool_size}): weights {fmt_bytes(mem.weights.total)} per rank ({experts})"]
    spec = plan.kv_spec
    page = (
        f"page {spec.page_size} tokens x {mem.shape.cache_layers} layers x ({spec.describe()}: "
        f"{spec.bytes_per_token} B per token) = {fmt_bytes(mem.page_bytes)}"
    )
    if mem.kv_budget is None or mem.kv_pages is None:
        lines.append(f"    KV cache: {mem.kv_budget_note}; {page}")
    else:
        lines.append(
            f"    KV cache: {fmt_bytes(mem.kv_budget)} ({mem.kv_budget_note}) = {mem.kv_pages} pages "
            f"= {mem.kv_pages * PAGE_SIZE} tokens per rank; {page}"
        )
    return lines


def describe_tiers(engine: EngineArgs) -> list[str]:
    """The prefix cache's tiers below the pool (host memory, disk), as one rank sizes them."""
    if not engine.enable_prefix_caching:
        return ["    prefix cache off: no KV tier below the pool"]
    host, how = engine.host_tier_bytes(free_memory(torch.device("cpu")))
    host_text = (
        f"host memory up to {fmt_bytes(host)} ({how}; taken as pages are evicted)"
        if host
        else "host tier off"
    )
    disk = (
        f"disk {engine.kv_disk_cache_dir} up to {fmt_bytes(engine.kv_disk_cache_size)}"
        if engine.kv_disk_cache_dir is not None
        else "disk tier off"
    )
    return [f"    KV tiers below the pool, per rank: {host_text}; {disk}"]


def describe_device(device: DevicePlan, gpu_memory: int | None, kind: str) -> list[str]:
    limit = f" of --gpu-memory {fmt_bytes(gpu_memory)}" if gpu_memory is not None else ""
    lines = [f"  per-{kind} memory{limit}:"]
    for part in device.parts:
        lines.append(f"    {part.name:<12} {fmt_bytes(part.bytes):>10}  {part.note}")
    verdict = ""
    if gpu_memory is not None:
        left = gpu_memory - device.total
        verdict = (
            f": fits, {fmt_bytes(left)} left" if left >= 0 else f": DOES NOT FIT ({fmt_bytes(-left)} over)"
        )
    lines.append(f"    {'total':<12} {fmt_bytes(device.total):>10}{verdict}")
    return lines


def _ranges(values: list[int]) -> str:
    """'0-7,12,20-21' for sorted distinct ints."""
    runs: list[list[int]] = []
    for v in values:
        if runs and runs[-1][1] == v - 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def describe_placement(plan: ModelPlan, engine: EngineArgs, pool_size: int, nnodes: int) -> list[str]:
    """Which logical experts each node's ranks hold (first MoE layer; default or --placement)."""
    c = plan.config
    if c.n_routed_experts == 0:
        return []
    mtp = 1 if engine.speculative_mtp else 0
    try:
        layers = moe_layer_ids(c, mtp)
    except ValueError as e:
        raise UsageError(f"--speculative-mtp: {e}") from None
    if engine.placement is not None:
        try:
            placement = ExpertPlacement.load(engine.placement)
            placement.check_matches(layers, c.n_routed_experts, pool_size)
        except ValueError as e:
            raise UsageError(f"--placement: {e}") from None
        source = f"--placement {engine.placement}"
    else:
        plan.rank(engine, pool_size)  # the clear refusal of a layout that cannot be spread
        try:
            placement = ExpertPlacement.for_model(c, pool_size, engine.num_redundant_experts, mtp)
        except ValueError as e:
            raise UsageError(f"expert placement: {e}") from None
        source = "default contiguous layout"
    slots = placement.slots_per_rank
    layer = layers[0]
    copies = Counter(placement.layers[layer])
    replicated = sum(1 for n in copies.values() if n > 1)
    lines = [
        f"  expert placement ({source}; layer {layer} of {len(layers)} MoE layers shown): "
        f"{placement.num_physical} slots, {slots} per rank; {replicated} experts replicated"
    ]
    per_node = pool_size // nnodes
    for node in range(nnodes):
        ranks = range(node * per_node, (node + 1) * per_node)
        held = sorted({e for r in ranks for e in placement.local_experts(layer, r)})
        lines.append(f"    node {node} ({_ranks(ranks[0], per_node)}): experts {_ranges(held)}")
    return lines


def header(plan: ModelPlan) -> str:
    dtype = str(plan.dtype).removeprefix("torch.")
    fp8 = ", FP8 weights kept" if plan.fp8 else (", FP8 weights dequantized" if plan.config.is_fp8 else "")
    return f"memory plan: model {plan.name}, {dtype} on {plan.device.type}{fp8}"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _ranks(first: int, count: int) -> str:
    return f"rank {first}" if count == 1 else f"ranks {first}-{first + count - 1}"


def _threads(pool: PoolArgs) -> str:
    threads = _plural(pool.threads, "thread")
    if pool.threads_per_rank is not None:
        return f"{threads} per rank"
    return f"{threads} per rank ({os.cpu_count()} cores here / {pool.ranks_per_node} local ranks)"


def _loopback(host: str) -> bool:
    return host == "localhost" or host.startswith("127.") or host == "::1"


def print_gateway_plan(gateway: GatewayArgs) -> None:
    from dsinfer.gateway.server import control_port_of

    print("dsinfer serve --role gateway (dry run: nothing is started)")
    print(f"  gateway: OpenAI API at http://{gateway.host}:{gateway.port}/v1")
    print(f"  control socket (the pools' --gateway-addr): {gateway.host}:{control_port_of(gateway)}")
    print(f"  balancer {gateway.balancer}, at most {gateway.max_queued_requests} queued requests")


def print_pool_plan(pool: PoolArgs, drain_timeout: float, gpu_memory: int | None = None) -> None:
    """Prints the plan; raises UsageError (after printing) when it does not fit ``gpu_memory``."""
    per_node, size = pool.ranks_per_node, pool.pool_size
    print(f"dsinfer serve --role {pool.role} (dry run: nothing is started)")
    print(
        f"  {pool.role} pool {pool.pool_id}: {_plural(size, 'rank')} (EP{size}/DP{size}) on "
        f"{_plural(pool.nnodes, 'node')}, {per_node} per node"
    )
    print(
        f"  this node (node-rank {pool.node_rank}): launcher + {_ranks(pool.node_rank * per_node, per_node)}, "
        f"{_threads(pool)}"
    )
    dist = pool.dist_init_addr or "127.0.0.1:<a free port at each pool start>"
    inbox = f"{pool.host}:<free port>" + (" (loopback: this machine only)" if _loopback(pool.host) else "")
    print(f"  ports: dist-init {dist}; gateway {pool.gateway_addr}; rank inboxes on {inbox}")
    if pool.role != "colocated":
        print(
            f"  KV transfer: {pool.transfer_backend}, timeout {pool.kv_transfer_timeout:g} s, "
            f"quarantine {pool.kv_quarantine:g} s"
        )
    dead = (
        f"the others serve on and it rejoins (elastic EP, collectives wait {pool.ep_timeout:g} s for a peer)"
        if pool.elastic
        else "the pool restarts whole"
    )
    print(
        f"  launcher: up to {pool.max_restarts} restarts, back-off {pool.restart_backoff:g} s "
        f"(doubling, capped at 30 s), drain timeout {drain_timeout:g} s; a rank dies: {dead}"
    )
    plan = model_plan(pool.engine)
    print("\n".join(describe_placement(plan, pool.engine, size, pool.nnodes)))
    print(header(plan))
    device = None
    if plan.device.type == "cuda" or gpu_memory is not None:
        device = device_plan(plan, pool.engine, pool.role, size, gpu_memory)
    mem = device.mem if device is not None else rank_memory(plan, pool.engine, size)
    print("\n".join(describe(plan, mem, f"{pool.role} pool", size) + describe_tiers(pool.engine)))
    if device is not None:
        kind = "GPU" if plan.device.type == "cuda" else "rank"
        print("\n".join(describe_device(device, gpu_memory, kind)))
        if gpu_memory is not None:
            check_fit(f"{pool.role} pool", size, device, gpu_memory)


def print_all_in_one_plan(
    layout: Layout, gateway: GatewayArgs, pools: list[PoolArgs], control_port: int | None
) -> None:
    control = str(control_port) if control_port else "a free port at start"
    print("dsinfer serve: all-in-one on this machine (dry run: nothing is started)")
    print(
        f"  processes: 1 gateway, {_plural(len(pools), 'pool launcher')}, {_plural(layout.num_ranks, 'rank')}"
    )
    print(f"  gateway: OpenAI API at http://{gateway.host}:{gateway.port}/v1, control port {control}")
    for pool in pools:
        size = pool.pool_size
        print(
            f"  {pool.role} pool {pool.pool_id}: {_plural(size, 'rank')} (EP{size}/DP{size}), "
            f"{_ranks(0, size)}, {_threads(pool)}"
        )
    print("  ports: each pool's dist-init and every rank's inbox take a free 127.0.0.1 port at start")
    plan = model_plan(pools[0].engine)
    print(header(plan))
    total = 0
    for role, size in dict.fromkeys((p.role, p.pool_size) for p in pools):
        mem = rank_memory(plan, pools[0].engine, size)
        print("\n".join(describe(plan, mem, f"{role} pools", size) + describe_tiers(pools[0].engine)))
        ranks = sum(p.pool_size for p in pools if (p.role, p.pool_size) == (role, size))
        total += ranks * (mem.weights.total + (mem.kv_budget or 0))
    print(f"  this machine: {fmt_bytes(total)} for {_plural(layout.num_ranks, 'rank')} (weights + KV caches)")
