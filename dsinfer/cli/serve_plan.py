"""``dsinfer serve --dry-run``: the memory plan of one rank (weights from config.json, KV pages).

Weights are counted from the model's shapes the way the loader lays them out: FP8 projections
(and routed experts) stay FP8 with fp32 128x128 block scales where the device runs FP8 GEMMs
(CUDA), everything else in the model dtype; with FP8 kept, MLA's absorbed path also holds a
dequantized copy of kv_b_proj. A rank of a pool of N holds ceil(n_routed_experts / N) routed
experts (expert parallelism; redundant experts not counted) and everything else whole.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dsinfer.base.config import FP8_BLOCK, PAGE_SIZE, ModelConfig
from dsinfer.base.presets import resolve_model
from dsinfer.cache.latent_pool import LatentKVPool
from dsinfer.engine.args import EngineArgs
from dsinfer.engine.engine import free_memory, resolve_device, resolve_dtype
from dsinfer.gateway.args import GatewayArgs
from dsinfer.workers.args import PoolArgs
from dsinfer.workers.launcher import threads_per_rank

if TYPE_CHECKING:
    from dsinfer.cli.serve_all_in_one import Layout


@dataclass(frozen=True)
class RankMemory:
    weight_bytes: int
    routed_experts: int  # routed experts this rank holds
    page_bytes: int  # one page (PAGE_SIZE tokens) over every cache layer
    kv_budget: int | None  # bytes for the latent cache; None = known only at start-up
    kv_budget_note: str
    kv_pages: int | None


@dataclass(frozen=True)
class ModelPlan:
    name: str
    config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    fp8: bool  # FP8 weights kept FP8
    cache_layers: int


def model_plan(engine: EngineArgs) -> ModelPlan:
    path, _ = resolve_model(engine.model)
    config = ModelConfig.from_file(path / "config.json")
    device = resolve_device(engine.device)
    dtype = resolve_dtype(engine.dtype, device)
    cache_layers = config.num_hidden_layers + (1 if engine.speculative_mtp else 0)
    fp8 = config.is_fp8 and device.type == "cuda"
    return ModelPlan(engine.model or path.name, config, device, dtype, fp8, cache_layers)


def rank_memory(plan: ModelPlan, engine: EngineArgs, pool_size: int) -> RankMemory:
    experts = math.ceil(plan.config.n_routed_experts / pool_size)
    weights = weight_bytes(plan, experts, mtp_layers=1 if engine.speculative_mtp else 0)
    page_bytes = LatentKVPool.page_bytes_for(plan.config, plan.cache_layers, plan.dtype)
    budget, note = _kv_budget(plan, engine)
    pages = None
    if budget is not None:
        pages = LatentKVPool.num_pages_for_budget(plan.config, plan.cache_layers, budget, plan.dtype)
    return RankMemory(weights, experts, page_bytes, budget, note, pages)


def _kv_budget(plan: ModelPlan, engine: EngineArgs) -> tuple[int | None, str]:
    if engine.kv_cache_memory is not None:
        return engine.kv_cache_memory, "--kv-cache-memory"
    fraction = engine.kv_cache_memory_fraction or (0.9 if plan.device.type == "cuda" else 0.1)
    what = f"{fraction:g} of free memory at start-up"
    if plan.device.type == "cuda" and not torch.cuda.is_available():
        return None, what + " (no GPU here to measure)"
    free = free_memory(plan.device)
    return int(free * fraction), f"{what} (free here now: {fmt_bytes(free)})"


def weight_bytes(plan: ModelPlan, routed_experts: int, mtp_layers: int) -> int:
    c, item = plan.config, plan.dtype.itemsize

    def dense(rows: int, cols: int) -> int:
        return rows * cols * item

    def proj(rows: int, cols: int) -> int:
        """A projection DeepSeek ships in FP8 (stays FP8 with fp32 block scales when kept)."""
        if not plan.fp8:
            return dense(rows, cols)
        return rows * cols + math.ceil(rows / FP8_BLOCK) * math.ceil(cols / FP8_BLOCK) * 4

    h, heads = c.hidden_size, c.num_attention_heads
    q_out = heads * c.qk_head_dim
    attn = (
        proj(c.q_lora_rank, h) + dense(1, c.q_lora_rank) + proj(q_out, c.q_lora_rank)
        if c.q_lora_rank
        else proj(q_out, h)
    )
    attn += proj(c.kv_cache_dim, h) + dense(1, c.kv_lora_rank)
    attn += proj(heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank) + proj(h, heads * c.v_head_dim)
    if plan.fp8:  # absorbed MLA keeps a dequantized kv_b_proj
        attn += dense(heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)
    norms = dense(2, h)
    mlp_dense = 3 * proj(c.intermediate_size, h)
    inter = c.moe_intermediate_size
    expert = 3 * (proj(inter, h) if inter % FP8_BLOCK == 0 else dense(inter, h))
    moe = dense(c.n_routed_experts, h) + c.n_routed_experts * 4 + routed_experts * expert
    moe += 3 * proj(inter * c.n_shared_experts, h) if c.n_shared_experts else 0

    def layer(i: int) -> int:
        return attn + norms + (moe if c.is_moe_layer(i) else mlp_dense)

    total = 2 * dense(c.vocab_size, h) + dense(1, h)  # embedding, lm_head, final norm
    total += sum(layer(i) for i in range(c.num_hidden_layers))
    for j in range(mtp_layers):  # own embedding, enorm, hnorm, eh_proj, layer, shared head
        total += dense(c.vocab_size, h) + dense(2, h) + dense(h, 2 * h) + layer(c.num_hidden_layers + j)
        total += dense(1, h) + dense(c.vocab_size, h)
    return total


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def describe(plan: ModelPlan, mem: RankMemory, label: str, pool_size: int) -> list[str]:
    c = plan.config
    lines = [
        f"  {label} (EP{pool_size}): weights {fmt_bytes(mem.weight_bytes)} per rank "
        f"({mem.routed_experts} of {c.n_routed_experts} routed experts)",
    ]
    page = f"page {PAGE_SIZE} tokens x {plan.cache_layers} layers x {c.kv_cache_dim} values = {fmt_bytes(mem.page_bytes)}"
    if mem.kv_budget is None or mem.kv_pages is None:
        lines.append(f"    KV cache: {mem.kv_budget_note}; {page}")
    else:
        lines.append(
            f"    KV cache: {fmt_bytes(mem.kv_budget)} ({mem.kv_budget_note}) = {mem.kv_pages} pages "
            f"= {mem.kv_pages * PAGE_SIZE} tokens per rank; {page}"
        )
    return lines


def header(plan: ModelPlan) -> str:
    dtype = str(plan.dtype).removeprefix("torch.")
    fp8 = ", FP8 weights kept" if plan.fp8 else (", FP8 weights dequantized" if plan.config.is_fp8 else "")
    return f"memory plan: model {plan.name}, {dtype} on {plan.device.type}{fp8}"


# What --dry-run prints ------------------------------------------------------------------------
def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _ranks(first: int, count: int) -> str:
    return f"rank {first}" if count == 1 else f"ranks {first}-{first + count - 1}"


def _threads(pool: PoolArgs) -> str:
    threads = _plural(threads_per_rank(pool), "thread")
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


def print_pool_plan(pool: PoolArgs, drain_timeout: float) -> None:
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
    print(
        f"  launcher: up to {pool.max_restarts} restarts, back-off {pool.restart_backoff:g} s "
        f"(doubling, capped at 30 s), drain timeout {drain_timeout:g} s"
    )
    plan = model_plan(pool.engine)
    print(header(plan))
    print("\n".join(describe(plan, rank_memory(plan, pool.engine, size), f"{pool.role} pool", size)))


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
        print("\n".join(describe(plan, mem, f"{role} pools", size)))
        ranks = sum(p.pool_size for p in pools if (p.role, p.pool_size) == (role, size))
        total += ranks * (mem.weight_bytes + (mem.kv_budget or 0))
    print(f"  this machine: {fmt_bytes(total)} for {_plural(layout.num_ranks, 'rank')} (weights + KV caches)")
