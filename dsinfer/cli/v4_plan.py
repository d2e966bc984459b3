"""``dsinfer serve --dry-run`` for a DeepSeek-V4 checkpoint: served PD or colocated by pools of one
rank or of several (expert parallelism), its weights on a rank by precision, its hybrid KV cache
by group next to V3's, and the pool's pages.

Weights are counted from the config (dsinfer/base/v4_weights.py, as the simulator counts them).
On CUDA the plan keeps FP8 what the release ships FP8 (every linear layer but the head; 128x128
blocks, a 4-byte scale each) and MXFP4 experts packed, as the loader does where the MXFP4 GEMM
runs; on a CPU every weight is in the model's dtype. The KV figures are the cache
spec's (dsinfer/base/kv_groups.py), the same the engine charges a page (dsinfer/cache/v4_pool.py).
"""

from __future__ import annotations

import torch

from dsinfer.base.config import ModelConfig
from dsinfer.base.kv_groups import HybridCacheSpec
from dsinfer.base.kv_spec import KVCacheSpec
from dsinfer.base.model_config import read_model_config
from dsinfer.base.presets import resolve_model
from dsinfer.base.rank_shape import expert_slots_per_rank
from dsinfer.base.v4_config import V4Config
from dsinfer.base.v4_weights import V4ParameterCounts
from dsinfer.cache.v4_pool import V4StatePool
from dsinfer.cli.errors import UsageError
from dsinfer.cli.memory_plan import CUDA_RUNTIME_RESERVE, fmt_bytes, fmt_bytes_down
from dsinfer.cli.serve_plan import describe_tiers
from dsinfer.engine.args import EngineArgs
from dsinfer.engine.device import free_memory, resolve_device, resolve_dtype

CONTEXTS = (8192, 131072, 1048576)  # one request's cache shown at these contexts
V3_PRESET = "deepseek-v3"


def _v3_bytes_per_token(dtype: torch.dtype) -> tuple[str, int]:
    config = ModelConfig.from_file(resolve_model(V3_PRESET)[0] / "config.json")
    spec = KVCacheSpec.for_model(config, str(dtype).removeprefix("torch."))
    return V3_PRESET, spec.bytes_per_token * config.num_hidden_layers


def v4_plan_lines(engine: EngineArgs, gpu_memory: int | None, pool_size: int = 1) -> list[str]:
    path, _ = resolve_model(engine.model)
    config = read_model_config(path / "config.json")
    assert isinstance(config, V4Config)
    device = resolve_device(engine.device)
    dtype = resolve_dtype(engine.dtype, device)
    dtype_name = str(dtype).removeprefix("torch.")
    cuda = device.type == "cuda"
    slots = expert_slots_per_rank(config.n_routed_experts, engine.num_redundant_experts, pool_size)
    mxfp4 = cuda and config.expert_dtype == "fp4"  # the MXFP4 GEMM kernel keeps them packed
    mtp = 1 if engine.speculative_mtp else 0  # the MTP layer: its weights and window
    share = slots / config.n_routed_experts
    weights = V4ParameterCounts.of(config, mtp).on_rank(dtype.itemsize, cuda, mxfp4, share)
    spec = HybridCacheSpec.for_v4(config, dtype_name, mtp_layers=mtp)
    page_bytes = V4StatePool.page_bytes_for(config, dtype)
    reserve = V4StatePool.reserve_bytes_for(config, dtype, engine.max_num_seqs, mtp)
    max_len = engine.max_model_len or config.max_position_embeddings
    held = "MXFP4, kept packed" if weights.mxfp4 else f"{dtype_name}: dequantised at load"
    if pool_size > 1:
        held += f"; {slots} of {config.n_routed_experts + engine.num_redundant_experts} slots per rank"
    fp8_part = f"FP8 {fmt_bytes(weights.fp8)} (linear layers, 128x128 block scales) + " if cuda else ""
    lines = [
        f"dsinfer serve: DeepSeek-V4, pools of {pool_size} rank{'s' if pool_size > 1 else ''} "
        "(dry run: nothing is started)",
        f"memory plan: model {engine.model or path.name}, {dtype_name} on {device.type}",
        f"  weights {fmt_bytes(weights.total)}: {fp8_part}routed experts {fmt_bytes(weights.experts)} ({held}) + "
        f"the rest {fmt_bytes(weights.other)} ({dtype_name})",
        f"  KV cache by group ({dtype_name}; pages of {spec.page_tokens} tokens):",
    ]
    for group in spec.groups:
        layers = f"    {group.name:<11} {len(group.layers)} layers x {group.width} values"
        if group.name == "window":
            held = spec.window * len(group.layers) * group.entry_bytes
            lines.append(f"{layers} per token, the last {spec.window} tokens: {fmt_bytes(held)} per sequence")
        else:
            per_token = group.entry_bytes * len(group.layers) / group.tokens_per_entry
            lines.append(f"{layers} per {group.tokens_per_entry} tokens: {per_token:,.0f} B per token")
    lines.append(
        f"    state       {fmt_bytes(spec.state_bytes)} per sequence at most (the compressors' unfinished rows)"
    )
    v3_name, v3_per_token = _v3_bytes_per_token(dtype)
    for context in CONTEXTS:
        v4 = sum(spec.exact_bytes(context).values()) + spec.state_bytes
        lines.append(
            f"  one request at {context:,} tokens: {fmt_bytes(v4)} ({v4 / context:,.0f} B per token); "
            f"{v3_name}: {fmt_bytes(v3_per_token * context)} ({v3_per_token:,} B per token)"
        )
    if gpu_memory is not None and weights.total + CUDA_RUNTIME_RESERVE > gpu_memory:
        raise UsageError(
            f"DeepSeek-V4 on a rank of a pool of {pool_size} needs {fmt_bytes(weights.total)} of weights + "
            f"{fmt_bytes(CUDA_RUNTIME_RESERVE)} runtime before any KV cache, more than --gpu-memory "
            f"{fmt_bytes_down(gpu_memory)}: spread the experts over more ranks (--pool-size)"
        )
    budget, how = engine.kv_cache_memory, "--kv-cache-memory"
    if budget is None and cuda and gpu_memory is None and not torch.cuda.is_available():
        lines.append(
            f"  KV cache: {engine.kv_fraction_for('cuda'):g} of free memory at start-up (no GPU here to "
            f"measure), less {fmt_bytes(reserve)} for --max-num-seqs {engine.max_num_seqs} sequences' windows "
            f"and state and as many resume points, in pages of {fmt_bytes(page_bytes)}"
        )
        budget = None
    else:
        if budget is None:
            free = (
                gpu_memory - weights.total - CUDA_RUNTIME_RESERVE
                if gpu_memory is not None
                else free_memory(device)
            )
            budget, how = engine.default_kv_budget(
                page_bytes=page_bytes,
                page_size=spec.page_tokens,
                max_model_len=max_len,
                free=max(free, 0),
                device_type=device.type,
            )
        pages = max(budget - reserve, 0) // page_bytes
        lines.append(
            f"  KV cache: {fmt_bytes(budget)} ({how}) = {fmt_bytes(reserve)} for --max-num-seqs "
            f"{engine.max_num_seqs} sequences' windows and state and as many resume points + {pages} pages of "
            f"{fmt_bytes(page_bytes)} = {pages * spec.page_tokens:,} tokens of compressed entries"
        )
        if pages < 1:
            raise UsageError(
                f"the KV cache ({fmt_bytes(budget)}) holds no page once {fmt_bytes(reserve)} are set aside "
                f"for --max-num-seqs {engine.max_num_seqs}: raise --kv-cache-memory or lower --max-num-seqs"
            )
    slot = V4StatePool.handoff_slot_bytes_for(config, dtype, mtp)
    lines.append(
        f"  PD: a prefill or decode rank also holds {engine.max_num_seqs} handoff slots of {fmt_bytes(slot)} "
        f"({fmt_bytes(slot * engine.max_num_seqs)}: the resume point at a prompt's last whole page)"
    )
    lines += [line.replace("    ", "  ", 1) for line in describe_tiers(engine)]
    lines.append(
        f"  steps: prefill chunks of up to {engine.max_num_batched_tokens} tokens; decode batches of up to "
        f"{engine.max_num_seqs} sequences"
    )
    if gpu_memory is not None:
        total = weights.total + (budget or 0) + CUDA_RUNTIME_RESERVE
        if total > gpu_memory:
            raise UsageError(
                f"DeepSeek-V4 on a rank of a pool of {pool_size} needs {fmt_bytes(total)} (weights "
                f"{fmt_bytes(weights.total)} + KV cache {fmt_bytes(budget or 0)} + runtime "
                f"{fmt_bytes(CUDA_RUNTIME_RESERVE)}), more than --gpu-memory {fmt_bytes_down(gpu_memory)}: spread "
                "the experts over more ranks (--pool-size) or lower --kv-cache-memory"
            )
        lines.append(f"  total {fmt_bytes(total)} of --gpu-memory {fmt_bytes(gpu_memory)}: fits")
    return lines
