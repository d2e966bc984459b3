"""``dsinfer serve --dry-run``: the layout, expert placement and memory plan of a configuration.

Nothing is loaded: weights are counted from config.json's shapes the way the loader lays them
out. FP8 projections (attention, dense MLPs, shared and routed experts) stay FP8 with fp32
128x128 block scales where the device runs FP8 GEMMs (CUDA); everything else (embedding,
lm_head, norms, router, MLA's dequantized kv_b_proj copy for the absorbed path) is in the model
dtype. A rank of a pool of N holds ``(n_routed_experts + num_redundant_experts) / N`` routed
expert slots (the default placement of ``dsinfer.parallel.placement``, or ``--placement FILE``)
and everything else whole.

On a GPU the plan adds up one GPU's memory: weights by precision, the latent KV cache, the EP
communication buffers, the KV transfer's registrations, an activation estimate for the largest
step, and a fixed reserve for the CUDA runtime. ``--gpu-memory SIZE`` refuses a plan whose total
does not fit, with a message naming what to change. The estimates and their formulas:

- DeepEP buffers (used when ``deep_ep`` is importable on an NCCL group; UNVERIFIED): normal mode
  (prefill, colocated) takes the larger of the NVLink and RDMA size hints of DeepEP's recommended
  dispatch and combine configs for the pool size; low-latency mode (decode) takes
  ``get_low_latency_rdma_size_hint(rows, hidden, ranks, slots)`` with ``rows = 128 x top_k`` as
  ``make_ep_group`` sizes it. Both mirror DeepEP's ``csrc/config.hpp`` formulas.
- KV transfer: NIXL and Mooncake register the KV cache in place (no staging copy): 0 extra bytes.
- Activations, for T tokens per step per rank (prefill and colocated: ``--max-num-batched-tokens``;
  decode: ``--max-num-seqs``, doubled with MTP): the larger of the MoE stage (``T x top_k`` rows
  received, each with its input, FP8 copy, gate/up output, activation and output) and MLA's
  decompressed attention (``T x heads x (2 qk_head_dim + 2 v_head_dim)``), plus the residual
  stream (4 copies of ``T x hidden``) and fp32 logits (2 copies of ``max_num_seqs x vocab``).
"""

from __future__ import annotations

import math
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from dsinfer.base.config import FP8_BLOCK, PAGE_SIZE, ModelConfig
from dsinfer.base.presets import resolve_model
from dsinfer.cache.latent_pool import LatentKVPool
from dsinfer.cli.errors import UsageError
from dsinfer.engine.args import EngineArgs
from dsinfer.engine.engine import free_memory, resolve_device, resolve_dtype
from dsinfer.gateway.args import GatewayArgs
from dsinfer.parallel.placement import ExpertPlacement, moe_layer_ids
from dsinfer.parallel.registry import deepep_unavailable
from dsinfer.workers.args import PoolArgs
from dsinfer.workers.launcher import threads_per_rank

if TYPE_CHECKING:
    from dsinfer.cli.serve_all_in_one import Layout

GiB = 2**30
CUDA_RUNTIME_RESERVE = 2 * GiB  # CUDA context, NCCL communicators, cuBLAS/DeepGEMM workspaces
LOW_LATENCY_TOKENS_PER_RANK = 128  # make_ep_group's max_tokens_per_rank (decode pools)

# DeepEP (csrc/config.hpp, deep_ep/buffer.py): Buffer.num_sms, peers per NVLink domain, and the
# recommended normal-mode configs per EP size, (dispatch, combine) x (NVLink send, NVLink
# receive, RDMA send, RDMA receive) chunk sizes in tokens.
DEEPEP_NUM_SMS = 20
DEEPEP_NVL_PEERS = 8
_DEEPEP_MAX_TOPK = _DEEPEP_MAX_SCALES = 128
_DEEPEP_SOURCE_META = 8
_DEEPEP_CONFIGS: dict[int, tuple[tuple[int, int, int, int], tuple[int, int, int, int]]] = {
    2: ((24, 256, 6, 128), (10, 256, 6, 128)),
    4: ((6, 256, 6, 128), (9, 256, 6, 128)),
    8: ((6, 256, 6, 128), (4, 256, 6, 128)),
    16: ((16, 288, 20, 128), (2, 288, 28, 128)),
    24: ((8, 288, 32, 128), (1, 288, 20, 128)),
    32: ((8, 288, 32, 128), (1, 288, 20, 128)),
    64: ((20, 288, 28, 128), (1, 288, 20, 128)),
    128: ((20, 560, 32, 128), (1, 560, 12, 128)),
    144: ((32, 720, 12, 128), (2, 720, 8, 128)),
    160: ((28, 720, 12, 128), (2, 720, 8, 128)),
}


# The model and one rank's share of it ---------------------------------------------------------
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


@dataclass(frozen=True)
class Weights:
    """Bytes per category, split by how they are stored: FP8 (with block scales) or the model dtype."""

    fp8: dict[str, int] = field(default_factory=dict)
    dense: dict[str, int] = field(default_factory=dict)

    @property
    def fp8_total(self) -> int:
        return sum(self.fp8.values())

    @property
    def dense_total(self) -> int:
        return sum(self.dense.values())

    @property
    def total(self) -> int:
        return self.fp8_total + self.dense_total


def weights_of(plan: ModelPlan, routed_experts: int, mtp_layers: int) -> Weights:
    """One rank's weights when it holds ``routed_experts`` routed expert slots per MoE layer."""
    c, item = plan.config, plan.dtype.itemsize
    fp8: Counter[str] = Counter()
    dense: Counter[str] = Counter()

    def plain(what: str, rows: int, cols: int, times: int = 1) -> None:
        dense[what] += rows * cols * item * times

    def proj(what: str, rows: int, cols: int, times: int = 1, fp8_ok: bool = True) -> None:
        """A projection DeepSeek ships in FP8 (stays FP8 with fp32 block scales when kept)."""
        if not (plan.fp8 and fp8_ok):
            plain(what, rows, cols, times)
            return
        scales = math.ceil(rows / FP8_BLOCK) * math.ceil(cols / FP8_BLOCK) * 4
        fp8[what] += (rows * cols + scales) * times

    h, heads = c.hidden_size, c.num_attention_heads
    inter = c.moe_intermediate_size

    def layer(i: int) -> None:
        if c.q_lora_rank:
            proj("attention", c.q_lora_rank, h)
            plain("norms + router", 1, c.q_lora_rank)
            proj("attention", heads * c.qk_head_dim, c.q_lora_rank)
        else:
            proj("attention", heads * c.qk_head_dim, h)
        proj("attention", c.kv_cache_dim, h)
        plain("norms + router", 1, c.kv_lora_rank)
        proj("attention", heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)
        proj("attention", h, heads * c.v_head_dim)
        if plan.fp8:  # absorbed MLA keeps a dequantized kv_b_proj
            plain("absorbed kv_b copy", heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)
        plain("norms + router", 2, h)
        if not c.is_moe_layer(i):
            proj("dense MLP", c.intermediate_size, h, times=3)
            return
        plain("norms + router", c.n_routed_experts, h)
        dense["norms + router"] += c.n_routed_experts * 4  # e_score_correction_bias (fp32)
        proj("routed experts", inter, h, times=3 * routed_experts, fp8_ok=inter % FP8_BLOCK == 0)
        if c.n_shared_experts:
            proj("shared experts", inter * c.n_shared_experts, h, times=3)

    plain("embedding + lm_head", c.vocab_size, h, times=2)
    plain("norms + router", 1, h)  # final norm
    for i in range(c.num_hidden_layers):
        layer(i)
    for j in range(mtp_layers):  # own embedding, enorm, hnorm, eh_proj, layer, norm, shared head
        plain("embedding + lm_head", c.vocab_size, h, times=2)
        plain("norms + router", 3, h)
        plain("MTP eh_proj", h, 2 * h)
        layer(c.num_hidden_layers + j)
    return Weights(dict(fp8), dict(dense))


def weight_bytes(plan: ModelPlan, routed_experts: int, mtp_layers: int) -> int:
    return weights_of(plan, routed_experts, mtp_layers).total


def expert_slots(config: ModelConfig, engine: EngineArgs, pool_size: int) -> int:
    """Routed expert slots per rank; UsageError when the pool cannot spread the experts evenly."""
    total = config.n_routed_experts + engine.num_redundant_experts
    if total % pool_size:
        raise UsageError(
            f"{config.n_routed_experts} routed + {engine.num_redundant_experts} redundant experts = {total} "
            f"slots cannot be spread evenly over {pool_size} ranks: choose --num-redundant-experts so that "
            f"{config.n_routed_experts} + it is a multiple of the pool size"
        )
    slots = total // pool_size
    if slots > config.n_routed_experts:
        raise UsageError(
            f"{slots} expert slots per rank exceed the model's {config.n_routed_experts} routed experts "
            f"(a rank would hold one expert twice): fewer --num-redundant-experts"
        )
    return slots


@dataclass(frozen=True)
class RankMemory:
    weights: Weights
    routed_experts: int  # routed expert slots this rank holds
    page_bytes: int  # one page (PAGE_SIZE tokens) over every cache layer
    kv_budget: int | None  # bytes for the latent cache; None = known only at start-up
    kv_budget_note: str
    kv_pages: int | None

    @property
    def weight_bytes(self) -> int:
        return self.weights.total


def rank_memory(plan: ModelPlan, engine: EngineArgs, pool_size: int, free: int | None = None) -> RankMemory:
    """``free``: the device memory left for the KV cache at start-up, when the plan knows it better
    than this machine (a planned GPU that is not here)."""
    experts = expert_slots(plan.config, engine, pool_size)
    weights = weights_of(plan, experts, mtp_layers=1 if engine.speculative_mtp else 0)
    page_bytes = LatentKVPool.page_bytes_for(plan.config, plan.cache_layers, plan.dtype)
    budget, note = _kv_budget(plan, engine, free)
    pages = None
    if budget is not None:
        pages = LatentKVPool.num_pages_for_budget(plan.config, plan.cache_layers, budget, plan.dtype)
    return RankMemory(weights, experts, page_bytes, budget, note, pages)


def _kv_budget(plan: ModelPlan, engine: EngineArgs, planned_free: int | None) -> tuple[int | None, str]:
    if engine.kv_cache_memory is not None:
        return engine.kv_cache_memory, "--kv-cache-memory"
    fraction = engine.kv_fraction_for(plan.device.type)
    what = f"{fraction:g} of free memory at start-up"
    if planned_free is not None:
        return int(max(planned_free, 0) * fraction), f"{what}: {fmt_bytes(planned_free)} by --gpu-memory"
    if plan.device.type == "cuda" and not torch.cuda.is_available():
        return None, what + " (no GPU here to measure)"
    free = free_memory(plan.device)
    return int(free * fraction), f"{what} (free here now: {fmt_bytes(free)})"


# Buffers and activations ----------------------------------------------------------------------
def _align(n: int, to: int = 128) -> int:
    return -(-n // to) * to


def deepep_normal_bytes(num_ranks: int, hidden_bytes: int) -> tuple[int, int] | None:
    """(NVLink, RDMA) bytes of a normal-mode buffer: the larger of the dispatch and combine size
    hints; None when DeepEP has no recommended config for ``num_ranks``."""
    configs = _DEEPEP_CONFIGS.get(num_ranks)
    if configs is None:
        return None
    channels = DEEPEP_NUM_SMS // 2
    nvl_ranks, rdma_ranks = min(num_ranks, DEEPEP_NVL_PEERS), max(num_ranks // DEEPEP_NVL_PEERS, 1)
    per_token = hidden_bytes + _DEEPEP_SOURCE_META + _DEEPEP_MAX_TOPK * 12 + _DEEPEP_MAX_SCALES * 4
    nvl = rdma = 0
    for _nvl_send, nvl_recv, rdma_send, rdma_recv in configs:
        n = channels * nvl_ranks * (2 * rdma_ranks + 3) * 4 + channels * nvl_ranks * nvl_recv * per_token
        nvl = max(nvl, _align(n))
        if num_ranks > DEEPEP_NVL_PEERS:
            recv = _align(rdma_recv, rdma_send)
            m = channels * rdma_ranks * (DEEPEP_NVL_PEERS * 2 + 2) * 2 * 4
            m += channels * rdma_ranks * recv * 2 * (per_token + 16)
            rdma = max(rdma, _align(m + 2**20))
    return nvl, rdma


def deepep_low_latency_bytes(rows: int, hidden: int, num_ranks: int, num_experts: int) -> int:
    """DeepEP's ``get_low_latency_rdma_size_hint``: odd/even send, receive and signaling buffers."""
    scales = hidden // 128
    dispatch_msg = 16 + max(hidden * 2, hidden + scales * 4)
    combine_msg = scales * 4 + hidden * 2
    send = max(rows * dispatch_msg, num_experts * rows * combine_msg)
    receive = num_experts * rows * max(dispatch_msg, combine_msg)
    signaling = _align(num_experts * 8 + (num_experts // num_ranks) * 4)
    return (2 * (send + receive + signaling) // 128 + 1) * 128


@dataclass(frozen=True)
class Part:
    name: str
    bytes: int
    note: str


def ep_buffers(plan: ModelPlan, role: str, pool_size: int, slots: int) -> Part:
    c = plan.config
    low_latency = role == "decode"
    mode = "low-latency" if low_latency else "normal"
    if plan.device.type != "cuda":
        return Part("EP buffers", 0, "torch all-to-all over gloo (no dedicated buffers)")
    why = deepep_unavailable(
        "nccl",
        True,
        pool_size,
        low_latency=low_latency,
        hidden=c.hidden_size,
        num_local_experts=slots,
    )
    if why is not None:
        return Part("EP buffers", 0, f"torch all-to-all over NCCL (no DeepEP: {why})")
    if low_latency:
        rows = LOW_LATENCY_TOKENS_PER_RANK * c.num_experts_per_tok
        n = deepep_low_latency_bytes(rows, c.hidden_size, pool_size, slots * pool_size)
        note = (
            f"DeepEP {mode} RDMA buffer for {rows} rows ({LOW_LATENCY_TOKENS_PER_RANK} tokens x top-"
            f"{c.num_experts_per_tok}) x {slots * pool_size} expert slots, if deep_ep is importable (UNVERIFIED)"
        )
        return Part("EP buffers", n, note)
    sizes = deepep_normal_bytes(pool_size, c.hidden_size * 2)
    if sizes is None:
        return Part(
            "EP buffers", 0, f"torch all-to-all (DeepEP has no normal-mode config for {pool_size} ranks)"
        )
    nvl, rdma = sizes
    note = f"DeepEP {mode} mode: NVLink {fmt_bytes(nvl)} + RDMA {fmt_bytes(rdma)}, if deep_ep is importable (UNVERIFIED)"
    return Part("EP buffers", nvl + rdma, note)


def step_tokens(role: str, engine: EngineArgs) -> tuple[int, str]:
    if role == "decode":
        per_seq = 2 if engine.speculative_mtp else 1
        what = f"--max-num-seqs {engine.max_num_seqs}" + (" x 2 (MTP)" if per_seq == 2 else "")
        return engine.max_num_seqs * per_seq, what
    return engine.max_num_batched_tokens, f"--max-num-batched-tokens {engine.max_num_batched_tokens}"


def activations(plan: ModelPlan, role: str, engine: EngineArgs) -> Part:
    c, item = plan.config, plan.dtype.itemsize
    tokens, what = step_tokens(role, engine)
    h, inter = c.hidden_size, c.moe_intermediate_size
    moe_row = 2 * h * item + h + 3 * inter * item  # in, FP8 copy, out; gate/up and activation
    moe = tokens * c.num_experts_per_tok * moe_row
    attention = tokens * c.num_attention_heads * (2 * c.qk_head_dim + 2 * c.v_head_dim) * item
    residual = 4 * tokens * h * item
    logits = 2 * engine.max_num_seqs * c.vocab_size * 4
    note = f"estimate for {tokens} tokens per step ({what}): max(MoE, attention) + residual + logits"
    return Part("activations", max(moe, attention) + residual + logits, note)


@dataclass(frozen=True)
class DevicePlan:
    parts: list[Part]
    kv_part: Part
    mem: RankMemory

    @property
    def total(self) -> int:
        return sum(p.bytes for p in self.parts)

    def part(self, name: str) -> Part:
        return next(p for p in self.parts if p.name == name)


def device_plan(
    plan: ModelPlan, engine: EngineArgs, role: str, pool_size: int, gpu_memory: int | None
) -> DevicePlan:
    slots = expert_slots(plan.config, engine, pool_size)
    mtp = 1 if engine.speculative_mtp else 0
    weights = weights_of(plan, slots, mtp)
    ep = ep_buffers(plan, role, pool_size, slots)
    runtime = CUDA_RUNTIME_RESERVE if plan.device.type == "cuda" else 0
    free = None
    if gpu_memory is not None and engine.kv_cache_memory is None:
        free = gpu_memory - runtime - weights.total - ep.bytes  # what the engine measures at KV sizing
    mem = rank_memory(plan, engine, pool_size, free)
    kv = Part("KV cache", mem.kv_budget or 0, _kv_note(mem))
    parts = [
        Part("weights", weights.total, _weights_note(plan, weights, slots)),
        kv,
        ep,
        Part("KV transfer", 0, _transfer_note(role, engine)),
        activations(plan, role, engine),
        Part("runtime", runtime, "CUDA context, NCCL, cuBLAS/DeepGEMM workspaces (fixed reserve)"),
    ]
    return DevicePlan(parts, kv, mem)


def _kv_note(mem: RankMemory) -> str:
    if mem.kv_budget is None or mem.kv_pages is None:
        return f"{mem.kv_budget_note}; not counted"
    return f"{mem.kv_budget_note}: {mem.kv_pages} pages = {mem.kv_pages * PAGE_SIZE} tokens"


def _transfer_note(role: str, engine: EngineArgs) -> str:
    if role == "colocated":
        return "no KV transfer (colocated)"
    disk = (
        f"; on-disk tier {engine.kv_disk_cache_dir} in host memory/disk" if engine.kv_disk_cache_dir else ""
    )
    return f"the KV cache is registered in place (no staging copy){disk}"


def _weights_note(plan: ModelPlan, weights: Weights, slots: int) -> str:
    def listing(parts: dict[str, int]) -> str:
        return ", ".join(f"{name} {fmt_bytes(n)}" for name, n in sorted(parts.items(), key=lambda x: -x[1]))

    dtype = str(plan.dtype).removeprefix("torch.")
    dense = f"{dtype} {fmt_bytes(weights.dense_total)} ({listing(weights.dense)})"
    if not weights.fp8:
        return dense
    return f"FP8 {fmt_bytes(weights.fp8_total)} ({listing(weights.fp8)}) + {dense}; {slots} routed slots per MoE layer"


def check_fit(label: str, pool_size: int, device: DevicePlan, gpu_memory: int) -> None:
    """UsageError naming the shortfall and what to change when the plan exceeds ``gpu_memory``."""
    total = device.total
    if total <= gpu_memory:
        return
    over = total - gpu_memory
    parts = " + ".join(f"{p.name} {fmt_bytes(p.bytes)}" for p in device.parts if p.bytes)
    if device.kv_part.bytes > over:
        fix = f"lower --kv-cache-memory to at most {fmt_bytes_down(device.kv_part.bytes - over)}"
    else:
        fix = "the rest does not fit even without a KV cache: use more ranks per pool or fewer redundant experts"
    raise UsageError(
        f"{label} (EP{pool_size}) does not fit: it needs {fmt_bytes(total)} per GPU ({parts}), "
        f"{fmt_bytes(over)} more than --gpu-memory {fmt_bytes(gpu_memory)}; {fix}"
    )


def check_pool_fits(pool: PoolArgs, gpu_memory: int) -> None:
    """The --gpu-memory check of a pool before it starts (nothing is loaded)."""
    plan = model_plan(pool.engine)
    device = device_plan(plan, pool.engine, pool.role, pool.pool_size, gpu_memory)
    check_fit(f"{pool.role} pool", pool.pool_size, device, gpu_memory)


# What --dry-run prints ------------------------------------------------------------------------
def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def fmt_bytes_down(n: int) -> str:
    """Like fmt_bytes, rounded down to what it prints (for limits: the printed size still fits)."""
    unit = next((u for u in (GiB, 2**20, 2**10) if n >= u), 1)
    if unit == 1:
        return f"{n} B"
    return fmt_bytes(math.floor(n / unit * 10) / 10 * unit)


def describe(plan: ModelPlan, mem: RankMemory, label: str, pool_size: int) -> list[str]:
    c = plan.config
    experts = f"{mem.routed_experts} of {c.n_routed_experts} routed experts"
    slots = mem.routed_experts * pool_size
    if slots > c.n_routed_experts:
        experts += f"; {slots} slots = {c.n_routed_experts} + {slots - c.n_routed_experts} redundant"
    lines = [f"  {label} (EP{pool_size}): weights {fmt_bytes(mem.weight_bytes)} per rank ({experts})"]
    page = f"page {PAGE_SIZE} tokens x {plan.cache_layers} layers x {c.kv_cache_dim} values = {fmt_bytes(mem.page_bytes)}"
    if mem.kv_budget is None or mem.kv_pages is None:
        lines.append(f"    KV cache: {mem.kv_budget_note}; {page}")
    else:
        lines.append(
            f"    KV cache: {fmt_bytes(mem.kv_budget)} ({mem.kv_budget_note}) = {mem.kv_pages} pages "
            f"= {mem.kv_pages * PAGE_SIZE} tokens per rank; {page}"
        )
    return lines


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
        expert_slots(c, engine, pool_size)  # the clear refusal of a layout that cannot be spread
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
    print(
        f"  launcher: up to {pool.max_restarts} restarts, back-off {pool.restart_backoff:g} s "
        f"(doubling, capped at 30 s), drain timeout {drain_timeout:g} s"
    )
    plan = model_plan(pool.engine)
    print("\n".join(describe_placement(plan, pool.engine, size, pool.nnodes)))
    print(header(plan))
    device = None
    if plan.device.type == "cuda" or gpu_memory is not None:
        device = device_plan(plan, pool.engine, pool.role, size, gpu_memory)
    mem = device.mem if device is not None else rank_memory(plan, pool.engine, size)
    print("\n".join(describe(plan, mem, f"{pool.role} pool", size)))
    if device is not None:
        kind = "GPU" if plan.device.type == "cuda" else "rank"
        print("\n".join(describe_device(device, gpu_memory, kind)))
        tokens, what = step_tokens(pool.role, pool.engine)
        if pool.role == "decode" and device.part("EP buffers").bytes and tokens > LOW_LATENCY_TOKENS_PER_RANK:
            print(
                f"  warning: a decode step of {tokens} tokens per rank ({what}) exceeds the "
                f"{LOW_LATENCY_TOKENS_PER_RANK} tokens DeepEP's low-latency buffer is sized for"
            )
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
        print("\n".join(describe(plan, mem, f"{role} pools", size)))
        ranks = sum(p.pool_size for p in pools if (p.role, p.pool_size) == (role, size))
        total += ranks * (mem.weight_bytes + (mem.kv_budget or 0))
    print(f"  this machine: {fmt_bytes(total)} for {_plural(layout.num_ranks, 'rank')} (weights + KV caches)")
