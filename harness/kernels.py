"""What the kernel benchmarks (benchmarks/kernels/) and the GPU kit share: DeepSeek-V3 and V3.2
shapes from the configs, a GPU timer (CUDA events around one call, L2 flushed before each), error
measures against the torch references, random block-FP8 weights, and the registers and spills of
the Triton kernels a process launched (read from Triton's JIT caches: the builds with the JIT's
own specialization, which an ahead-of-time compile with a hand-written signature only
approximates)."""

from __future__ import annotations

import importlib
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "models" / "deepseek-v3" / "config.json"
CONFIG_V32 = ROOT / "configs" / "models" / "deepseek-v3.2" / "config.json"
DEVICE = "cuda"  # one GPU: the current CUDA device (CUDA_VISIBLE_DEVICES picks it); "cpu": smoke
FP8_BLOCK = 128
FLUSH_BYTES = 256 << 20  # > L2 of any current GPU (H100/H200: 50 MB)
MIN_ITERS = 3


def import_kernels() -> ModuleType:
    """dsinfer's Triton kernels (``dsinfer.kernels``, the install's mapping of kernels/)."""
    return importlib.import_module("dsinfer.kernels")


# Model shapes ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class V3:
    hidden: int
    intermediate: int
    moe_intermediate: int
    heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope: int
    qk_rope: int
    v_head: int
    experts: int
    n_group: int
    topk_group: int
    top_k: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    softmax_scale: float

    @property
    def kv_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope


def load_v3(path: Path = CONFIG) -> V3:
    from dsinfer.base.config import ModelConfig

    c = ModelConfig.from_file(path)
    return V3(
        hidden=c.hidden_size,
        intermediate=c.intermediate_size,
        moe_intermediate=c.moe_intermediate_size,
        heads=c.num_attention_heads,
        q_lora_rank=c.q_lora_rank or c.hidden_size,
        kv_lora_rank=c.kv_lora_rank,
        qk_nope=c.qk_nope_head_dim,
        qk_rope=c.qk_rope_head_dim,
        v_head=c.v_head_dim,
        experts=c.n_routed_experts,
        n_group=c.n_group,
        topk_group=c.topk_group,
        top_k=c.num_experts_per_tok,
        norm_topk_prob=c.norm_topk_prob,
        routed_scaling_factor=c.routed_scaling_factor,
        softmax_scale=c.softmax_scale,
    )


@dataclass(frozen=True)
class V32Sparse:
    """DeepSeek-V3.2's indexer and sparse MLA shapes."""

    index_heads: int
    index_dim: int
    topk: int
    heads: int
    dim: int  # latent + rope values per cached token (576)
    dim_v: int
    softmax_scale: float


def load_v32_sparse(path: Path = CONFIG_V32) -> V32Sparse:
    from dsinfer.base.config import ModelConfig

    c = ModelConfig.from_file(path)
    assert c.index_n_heads and c.index_head_dim and c.index_topk, f"{path} has no indexer"
    return V32Sparse(
        index_heads=c.index_n_heads,
        index_dim=c.index_head_dim,
        topk=c.index_topk,
        heads=c.num_attention_heads,
        dim=c.kv_lora_rank + c.qk_rope_head_dim,
        dim_v=c.kv_lora_rank,
        softmax_scale=c.softmax_scale,
    )


def projection_shapes(v3: V3) -> list[tuple[str, int, int]]:
    """(name, n, k) of V3's block-FP8 linear layers (full, unsharded shapes)."""
    qk = v3.qk_nope + v3.qk_rope
    return [
        ("q_a_proj", v3.q_lora_rank, v3.hidden),
        ("q_b_proj", v3.heads * qk, v3.q_lora_rank),
        ("kv_a_proj_with_mqa", v3.kv_dim, v3.hidden),
        ("q_a + kv_a stacked", v3.q_lora_rank + v3.kv_dim, v3.hidden),  # MLA.stack_a_proj: one GEMM
        ("kv_b_proj", v3.heads * (v3.qk_nope + v3.v_head), v3.kv_lora_rank),
        ("o_proj", v3.hidden, v3.heads * v3.v_head),
        ("dense gate_proj/up_proj", v3.intermediate, v3.hidden),
        ("dense down_proj", v3.hidden, v3.intermediate),
        ("shared expert w13", 2 * v3.moe_intermediate, v3.hidden),
        ("shared expert w2", v3.hidden, v3.moe_intermediate),
    ]


# Timing and errors ------------------------------------------------------------------------------
class Timer:
    """GPU time of one call: first call, warm-up, then the median of ``iters`` Event-timed calls,
    each after zeroing a buffer larger than L2. Slow functions get fewer calls (``max_s`` each).
    On a CPU device (the smoke run) calls are timed on the host and nothing is flushed."""

    def __init__(self, warmup: int, iters: int, max_s: float, device: str = DEVICE) -> None:
        self.warmup, self.iters, self.max_s = warmup, iters, max_s
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.flush = torch.empty(FLUSH_BYTES // 4 if self.cuda else 1, dtype=torch.int32, device=self.device)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def __call__(self, fn: Callable[[], Any], flush: bool = True) -> dict[str, float]:
        fn()  # compilation, autotuning, allocator growth
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        once = max(time.perf_counter() - t0, 1e-6)
        affordable = int(self.max_s / once)
        iters = max(MIN_ITERS, min(self.iters, affordable))
        for _ in range(min(self.warmup, max(0, affordable - iters))):
            fn()
        if not self.cuda:
            ms = []
            for _ in range(iters):
                t0 = time.perf_counter()
                fn()
                ms.append((time.perf_counter() - t0) * 1e3)
            ms.sort()
            return {
                "median_us": 1e3 * statistics.median(ms),
                "min_us": 1e3 * ms[0],
                "max_us": 1e3 * ms[-1],
                "iters": iters,
            }
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        for start, end in zip(starts, ends, strict=True):
            if flush:
                self.flush.zero_()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        ms = sorted(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))
        return {
            "median_us": 1e3 * statistics.median(ms),
            "min_us": 1e3 * ms[0],
            "max_us": 1e3 * ms[-1],
            "iters": iters,
        }


# max |diff| / max |ref| of the bf16 outputs of FP8 GEMMs. Hopper's FP8 tensor cores accumulate each
# 128-wide K block in reduced precision before the fp32 scaling (DeepGEMM's promotion point), which
# leaves about two bf16 ulps at the largest outputs (1.02-1.07% measured on an H100): the adapters' 2%.
GEMM_TOL = 2e-2


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref| (NaN anywhere gives NaN)."""
    out, ref = out.float(), ref.float()
    if out.shape != ref.shape:
        return float("nan")
    scale = ref.abs().max().item() if ref.numel() else 0.0
    diff = (out - ref).abs().max().item() if ref.numel() else 0.0
    if math.isnan(diff) or bool(torch.isnan(out).any()):
        return float("nan")
    return diff / (scale or 1.0)


def max_abs_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if out.shape != ref.shape:
        return float("nan")
    return (out.float() - ref.float()).abs().max().item() if ref.numel() else 0.0


def free_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def gen(device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(0)


def fp8_weights(
    g: torch.Generator, lead: tuple[int, ...], n: int, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random fp8 e4m3 weights ``[*lead, n, k]`` with positive 128x128 block scales."""
    w = torch.randn(*lead, n, k, device=g.device, dtype=torch.bfloat16, generator=g).to(torch.float8_e4m3fn)
    nb, kb = -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)
    s = torch.rand(*lead, nb, kb, device=g.device, generator=g) * 1e-2 + 1e-3
    return w, s


def scaled_mm(a: torch.Tensor, b: torch.Tensor, one: torch.Tensor, fast: bool) -> torch.Tensor:
    """``a @ b`` in fp8 with per-tensor scales (``b`` column-major), bf16 out."""
    out = torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=fast)
    return out[0] if isinstance(out, tuple) else out  # torch < 2.4 returned (out, amax)


def has_fp8(device: torch.device) -> bool:
    """fp8 e4m3 tensor cores (compute capability 8.9+); the Triton interpreter emulates them on a CPU."""
    if device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(device) >= (8, 9) and hasattr(torch, "float8_e4m3fn")


# Registers and spills of the launched kernels ----------------------------------------------------
MODULES = (
    "dsinfer.kernels.mla_decode",
    "dsinfer.kernels.mla_decode_tma",
    "dsinfer.kernels.fp8_gemm",
    "dsinfer.kernels.grouped_gemm",
    "dsinfer.kernels.indexer",
    "dsinfer.kernels.sparse_mla",
    "dsinfer.kernels.moe_gate",
)


def _jit_functions() -> list[tuple[str, Any]]:
    from triton.runtime.jit import JITFunction

    found = []
    for name in MODULES:
        try:
            module = importlib.import_module(name)
        except Exception:  # a module the run never needed may not import here: nothing to read
            continue
        found += [(f"{name.rsplit('.', 1)[-1]}.{attr}", value) for attr, value in vars(module).items()
                  if isinstance(value, JITFunction)]  # fmt: skip
    return found


def _constexprs(fn: Any, constants: dict[Any, Any]) -> dict[str, str]:
    """The upper-case (tile) constexprs of one build; Triton keys them by name or by (index,)."""
    out = {}
    for key, value in constants.items():
        name = fn.arg_names[key[0]] if isinstance(key, tuple) and len(key) == 1 else str(key)
        if name.isupper():
            out[name] = str(value)
    return out


def jit_usage() -> list[dict[str, Any]]:
    """One row per compiled kernel: name, warps, stages, shared bytes, registers, spilled bytes
    (``n_spills``; ``None`` until the kernel was loaded on a device)."""
    rows = []
    for name, fn in _jit_functions():
        for caches in getattr(fn, "device_caches", {}).values():
            for compiled in caches[0].values():
                meta = compiled.metadata
                constants = _constexprs(fn, getattr(getattr(compiled, "src", None), "constants", None) or {})
                rows.append({
                    "kernel": name,
                    "constexprs": constants,
                    "num_warps": getattr(meta, "num_warps", None),
                    "num_stages": getattr(meta, "num_stages", None),
                    "shared_bytes": getattr(meta, "shared", None),
                    "registers": getattr(compiled, "n_regs", None),
                    "spills": getattr(compiled, "n_spills", None),
                })  # fmt: skip
    return rows
