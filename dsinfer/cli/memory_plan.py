"""The memory plan of one rank of a configuration (what ``dsinfer serve --dry-run`` prints and
``--gpu-memory`` checks). Nothing is loaded: weights, KV bytes per token and expert slots per rank
are counted by ``dsinfer.base.rank_shape.RankShape`` (the simulator's accounting too), with FP8
weights kept FP8 where the device runs FP8 GEMMs (CUDA).

On a GPU the plan adds up one GPU's memory: weights by precision, the latent KV cache, the EP
communication buffers, the KV transfer's registrations, an activation estimate for the largest
step, and a fixed reserve for the CUDA runtime. ``--gpu-memory SIZE`` refuses a plan whose total
does not fit, with a message naming what to change. The estimates and their formulas:

- DeepEP buffers (used when ``deep_ep`` is importable on an NCCL group and ``--ep-backend`` is not
  torch; UNVERIFIED): normal mode
  (prefill, colocated) takes the larger of the NVLink and RDMA size hints of DeepEP's recommended
  dispatch and combine configs for the pool size; low-latency mode (decode) takes
  ``get_low_latency_rdma_size_hint(tokens, hidden, ranks, slots)`` for the tokens of a decode step
  per rank (``EngineArgs.decode_tokens_per_step``: ``--max-num-seqs``, doubled with MTP), as the
  rank sizes it. Both mirror DeepEP's ``csrc/config.hpp`` formulas.
- KV transfer: NIXL and Mooncake register the KV cache in place (no staging copy): 0 extra bytes.
- Activations, for T tokens per step per rank (prefill and colocated: ``--max-num-batched-tokens``;
  decode: ``--max-num-seqs``, doubled with MTP): the larger of the MoE stage (``T x top_k`` rows
  received, each with its input, FP8 copy, gate/up output, activation and output) and MLA's
  decompressed attention (``T x heads x (2 qk_head_dim + 2 v_head_dim)``), plus the residual
  stream (4 copies of ``T x hidden``) and fp32 logits (2 copies of ``max_num_seqs x vocab``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dsinfer.base.config import PAGE_SIZE, ModelConfig
from dsinfer.base.kv_spec import KVCacheSpec
from dsinfer.base.presets import resolve_model
from dsinfer.base.rank_shape import RankShape, WeightBytes
from dsinfer.cli.errors import UsageError
from dsinfer.engine.args import EngineArgs
from dsinfer.engine.device import free_memory, resolve_device, resolve_dtype
from dsinfer.model.indexer import LOGITS_BUDGET
from dsinfer.parallel.ep_select import deepep_unavailable
from dsinfer.workers.args import PoolArgs

GiB = 2**30
CUDA_RUNTIME_RESERVE = 2 * GiB  # CUDA context, NCCL communicators, cuBLAS/DeepGEMM workspaces

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
    kv_spec: KVCacheSpec  # one cache layer's per-token caches (V3.2: latent + indexer keys)

    def rank(self, engine: EngineArgs, pool_size: int) -> RankShape:
        """One rank's shape in a pool of ``pool_size``; UsageError when the experts cannot be spread."""
        try:
            return RankShape(
                self.config,
                self.dtype.itemsize,
                self.fp8,
                pool_size,
                engine.num_redundant_experts,
                mtp_layers=1 if engine.speculative_mtp else 0,
                cache_bytes_per_token=self.kv_spec.bytes_per_token,
            )
        except ValueError as e:  # the experts cannot be spread over the pool
            raise UsageError(f"{e} (--num-redundant-experts, --pool-size)") from None


def model_plan(engine: EngineArgs) -> ModelPlan:
    path, _ = resolve_model(engine.model)
    config = ModelConfig.from_file(path / "config.json")
    device = resolve_device(engine.device)
    dtype = resolve_dtype(engine.dtype, device)
    fp8 = config.is_fp8 and device.type == "cuda"
    indexer = engine.indexer_format_for(device.type)
    spec = KVCacheSpec.for_model(config, str(dtype).removeprefix("torch."), indexer)
    return ModelPlan(engine.model or path.name, config, device, dtype, fp8, spec)


@dataclass(frozen=True)
class RankMemory:
    shape: RankShape
    weights: WeightBytes
    page_bytes: int  # one page (PAGE_SIZE tokens) over every cache layer
    kv_budget: int | None  # bytes for the latent cache; None = known only at start-up
    kv_budget_note: str
    kv_pages: int | None


def rank_memory(plan: ModelPlan, engine: EngineArgs, pool_size: int, free: int | None = None) -> RankMemory:
    """``free``: the device memory left for the KV cache at start-up, when the plan knows it better
    than this machine (a planned GPU that is not here)."""
    shape = plan.rank(engine, pool_size)
    budget, note = _kv_budget(plan, engine, shape.page_bytes(), free)
    pages = shape.kv_pages(budget) if budget is not None else None
    return RankMemory(shape, shape.weights(), shape.page_bytes(), budget, note, pages)


def _kv_budget(
    plan: ModelPlan, engine: EngineArgs, page_bytes: int, planned_free: int | None
) -> tuple[int | None, str]:
    if engine.kv_cache_memory is not None:
        return engine.kv_cache_memory, "--kv-cache-memory"
    device = plan.device.type
    if planned_free is not None:
        budget, note = _default_kv_budget(plan, engine, page_bytes, planned_free)
        return budget, f"{note}, by --gpu-memory"
    if device == "cuda" and not torch.cuda.is_available():
        return None, f"{engine.kv_fraction_for(device):g} of free memory at start-up (no GPU here to measure)"
    return _default_kv_budget(plan, engine, page_bytes, free_memory(plan.device))


def _default_kv_budget(plan: ModelPlan, engine: EngineArgs, page_bytes: int, free: int) -> tuple[int, str]:
    return engine.default_kv_budget(
        page_bytes=page_bytes,
        page_size=PAGE_SIZE,
        max_model_len=engine.max_model_len or plan.config.max_position_embeddings,
        free=free,
        device_type=plan.device.type,
    )


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


def ep_buffers(
    plan: ModelPlan, role: str, pool_size: int, slots: int, backend: str = "auto", tokens_per_rank: int = 256
) -> Part:
    """``tokens_per_rank``: what a decode rank's low-latency buffer holds (a decode step's tokens)."""
    c = plan.config
    low_latency = role == "decode"
    mode = "low-latency" if low_latency else "normal"
    if plan.device.type != "cuda":
        return Part("EP buffers", 0, "torch all-to-all over gloo (no dedicated buffers)")
    if backend == "torch":
        return Part("EP buffers", 0, "torch all-to-all over NCCL (--ep-backend torch)")
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
        n = deepep_low_latency_bytes(tokens_per_rank, c.hidden_size, pool_size, slots * pool_size)
        note = (
            f"DeepEP {mode} RDMA buffer for {tokens_per_rank} tokens per rank x {slots * pool_size} expert "
            "slots, if deep_ep is importable (UNVERIFIED)"
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
        per_seq = 1 + engine.num_drafts
        what = f"--max-num-seqs {engine.max_num_seqs}" + (f" x {per_seq} (MTP)" if per_seq > 1 else "")
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
    if c.is_sparse:  # V3.2: fp32 indexer logits of a block of queries over the longest context
        context = engine.max_model_len or c.max_position_embeddings
        attention += 4 * min(tokens * context, LOGITS_BUDGET)
        note += " (attention with the indexer's logits over the context)"
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
    shape = plan.rank(engine, pool_size)
    slots, weights = shape.expert_slots, shape.weights()
    ep = ep_buffers(plan, role, pool_size, slots, engine.ep_backend, engine.decode_tokens_per_step())
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


def _weights_note(plan: ModelPlan, weights: WeightBytes, slots: int) -> str:
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
