"""dsinfer's Triton kernels on a CUDA GPU at DeepSeek-V3 shapes, against this GPU's measured
ceilings and against torch's own path (the ``dsinfer.ops`` reference of the same signature).

1. Ceilings, measured in the same run: device-to-device copy bandwidth (``Tensor.copy_`` of large
   buffers; bytes = read + write), the bf16 matmul rate (``torch.mm`` at large square sizes) and
   the fp8 e4m3 matmul rate (``torch._scaled_mm`` with per-tensor scales, fast accumulation on and
   off; the best of all is the ceiling; 2x the bf16 rate when ``_scaled_mm`` is unavailable).
2. Each kernel of ``dsinfer.kernels`` (shapes from configs/models/deepseek-v3/config.json):

   - ``mla_decode``: bf16 paged latent cache (page 64, 576 values per token, pages scattered),
     batch 64 and 128, 4K-token contexts, 1 and 2 query tokens (causal), 16 query heads (one TP8
     rank: memory-bound, reported as latent-cache bytes/s against the copy bandwidth, target
     > 80%) and 128 heads (reported as the fraction of the roofline bound min(compute, memory),
     target > 60%).
   - ``fp8_gemm_nt``: the block-FP8 dense GEMM at V3 projection shapes, decode and prefill rows.
   - ``m_grouped_fp8_gemm_nt_contiguous`` / ``_masked``: V3 expert GEMMs (w13 ``[E, 4096, 7168]``,
     w2 ``[E, 7168, 2048]``) at 32..512 tokens per expert; TFLOP/s against the fp8 matmul rate
     (target > 60% at >= 256 tokens per expert).
   - ``moe_gate``: the fused noaux_tc gate at 256 experts, 1..16K tokens.
   - ``sparse`` (DeepSeek-V3.2, configs/models/deepseek-v3.2): ``indexer_logits`` over the FP8 key
     cache (64 heads x 128, uint8 ``[pages, 64, 132]``; key bytes/s against the copy bandwidth)
     and ``sparse_mla_decode`` over 2048 picked slots per query (128 heads x 576/512; fraction of
     the roofline), batch 64 and 128, 4K and 16K contexts, one query token.

   Every case also times the same ``Ops`` entry point through torch's reference (``torch`` column;
   ``speedup`` = torch / Triton path), and checks the kernel's output against that reference once.
   MLA cases whose default launch is the TMA kernel also time the pointer kernel at its fallback
   launch (``triton_pointer``).
3. DeepSeek's libraries where they import (CUDA, compute capability 9.0): FlashMLA through
   dsinfer's adapter (MLA, sparse MLA), DeepGEMM raw and through the adapter (dense, grouped, the
   V3.2 indexer), each timed and checked like the Triton kernels; a failure is that entry's error
   (``results["library_errors"]``), never the case's. ``results["meta"]["libraries"]`` says what
   imported (version, file) or why not.

Times are GPU times between two ``torch.cuda.Event`` records around one call: a first call
(compilation), warm-up calls, then the median of N timed calls; before every timed call a 256 MiB
buffer is zeroed so that no operand stays in L2 from the call before. Prints tables and writes JSON
(``--out``, default benchmarks/results/kernels_gpu.json). Without a CUDA device it prints one line
and exits 0; ``--list`` prints the planned cases (shapes, FLOPs, bytes) without a GPU.
``--device cpu --tiny`` (with ``TRITON_INTERPRET=1``) runs every section at tiny shapes on the CPU,
timed on the host: the plumbing only, no figure means anything (scripts/gpu-check --cpu-smoke).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.metadata
import math
import os
import platform
import shlex
import sys
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar, NamedTuple

import torch

from harness.kernels import (
    CONFIG,
    CONFIG_V32,
    DEVICE,
    FLUSH_BYTES,
    FP8_BLOCK,
    GEMM_TOL,
    ROOT,
    V3,
    Timer,
    V32Sparse,
    fp8_weights,
    free_memory,
    gen,
    has_fp8,
    import_kernels,
    jit_usage,
    load_v3,
    load_v32_sparse,
    max_abs_err,
    projection_shapes,
    rel_err,
    scaled_mm,
)
from harness.plots import plot_result
from harness.progress import log
from harness.provenance import git_state
from harness.results import write_json

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "kernels_gpu.json"

PAGE_SIZE = 64  # FlashMLA's page size, dsinfer's default KV page
BF16 = 2  # bytes

# Targets of the brief (reported as met/missed, never enforced).
TARGET_MLA_MEMORY = 0.80  # 16 heads: latent-cache bytes/s / copy bandwidth
TARGET_MLA_ROOFLINE = 0.60  # 128 heads: roofline bound time / measured time
TARGET_GROUPED_FP8 = 0.60  # grouped GEMMs: TFLOP/s / fp8 matmul rate ...
TARGET_GROUPED_MIN_TOKENS = 256  # ... at >= this many tokens per expert

SECTIONS = ("mla", "gemm", "grouped", "gate", "sparse")
LIBRARIES = {"deep_gemm": "deepgemm", "flash_mla": "flashmla"}  # module -> capability_unsupported's name
# Entries of a case measured apart from its main one: a failure is the entry's error, not the case's.
TRITON_ENTRIES = ("triton_pointer", "indexer", "indexer_topk", "sparse_mla")
LIBRARY_ENTRIES = ("flashmla", "deepgemm", "ops_deepgemm")


# ---------------------------------------------------------------------------------------- cases


class Named:
    """A case named by its ``LABEL`` filled in with its fields."""

    LABEL: ClassVar[str]

    @property
    def name(self) -> str:
        return self.LABEL.format(**vars(self))


@dataclass(frozen=True)
class MlaCase(Named):
    LABEL = "B{batch} h{heads} s_q{s_q} ctx{ctx}"
    batch: int
    heads: int
    s_q: int
    ctx: int
    dim: int  # latent + rope values per cached token (576)
    dim_v: int  # latent values (512)

    @property
    def cache_bytes(self) -> int:
        """The latent cache of every sequence, read once (bf16)."""
        return self.batch * self.ctx * self.dim * BF16

    @property
    def total_bytes(self) -> int:
        """Cache + q + out (bf16) + lse (fp32) + block table and lengths (int32)."""
        rows = self.batch * self.s_q * self.heads
        table = self.batch * (-(-self.ctx // PAGE_SIZE) + 1) * 4
        return self.cache_bytes + rows * (self.dim + self.dim_v) * BF16 + rows * 4 + table

    @property
    def flops(self) -> int:
        """2 * (dim + dim_v) per (query row, visible key); token j of s_q sees ctx - s_q + j + 1 keys."""
        keys = sum(self.ctx - self.s_q + j + 1 for j in range(self.s_q))
        return 2 * (self.dim + self.dim_v) * self.heads * keys * self.batch


@dataclass(frozen=True)
class GemmCase:
    name: str
    m: int
    n: int
    k: int

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k

    @property
    def bytes(self) -> int:
        """fp8 A and B, bf16 D, fp32 scales (1x128 for A, 128x128 for B)."""
        kb, nb = -(-self.k // FP8_BLOCK), -(-self.n // FP8_BLOCK)
        return self.m * self.k + self.n * self.k + self.m * self.n * BF16 + 4 * (self.m * kb + nb * kb)


@dataclass(frozen=True)
class GroupedCase(Named):
    LABEL = "{layout} {weight} E{experts} m{tokens}"
    layout: str  # "contiguous" or "masked"
    weight: str  # "w13" or "w2"
    experts: int
    tokens: int  # valid rows per expert
    n: int
    k: int
    align: int  # contiguous: rows per expert segment rounded up to this (-1 rows pad); masked: m_max

    @property
    def rows_per_expert(self) -> int:
        """Rows each expert occupies in A (contiguous: padded segment; masked: m_max)."""
        return -(-self.tokens // self.align) * self.align

    @property
    def flops(self) -> int:
        return 2 * self.experts * self.tokens * self.n * self.k

    @property
    def bytes(self) -> int:
        kb, nb = -(-self.k // FP8_BLOCK), -(-self.n // FP8_BLOCK)
        rows = self.experts * self.tokens
        weights = self.experts * (self.n * self.k + 4 * nb * kb)
        return weights + rows * (self.k + 4 * kb) + rows * self.n * BF16


@dataclass(frozen=True)
class GateCase(Named):
    LABEL = "T{tokens} E{experts}"
    tokens: int
    experts: int
    n_group: int
    topk_group: int
    top_k: int

    @property
    def bytes(self) -> int:
        """fp32 logits in, fp32 weights and int64 ids out."""
        return self.tokens * (self.experts * 4 + self.top_k * 12)


@dataclass(frozen=True)
class SparseCase(Named):
    LABEL = "B{batch} ctx{ctx} h{heads} topk{topk}"
    batch: int
    ctx: int  # visible keys per sequence (one query token: it sees them all)
    index_heads: int
    index_dim: int
    topk: int
    heads: int
    dim: int
    dim_v: int

    @property
    def picked(self) -> int:
        return min(self.topk, self.ctx)

    @property
    def key_bytes(self) -> int:
        """The FP8 index keys of every sequence with their fp32 scales, read once."""
        return self.batch * self.ctx * (self.index_dim + 4)

    @property
    def logits_bytes(self) -> int:
        """fp32 logits written, one per slot of the block table."""
        return self.batch * -(-self.ctx // PAGE_SIZE) * PAGE_SIZE * 4

    @property
    def indexer_flops(self) -> int:
        return 2 * self.index_heads * self.index_dim * self.ctx * self.batch

    @property
    def sparse_bytes(self) -> int:
        """The picked latent rows (bf16) and their indices (int32), q and out (bf16), lse (fp32)."""
        rows = self.batch * self.heads
        per_seq = self.picked * (self.dim * BF16 + 4)
        return self.batch * per_seq + rows * (self.dim + self.dim_v) * BF16 + rows * 4

    @property
    def sparse_flops(self) -> int:
        return 2 * (self.dim + self.dim_v) * self.heads * self.picked * self.batch


@dataclass
class Plan:
    mla: list[MlaCase]
    gemm: list[GemmCase]
    grouped: list[GroupedCase]
    gate: list[GateCase]
    sparse: list[SparseCase]
    copy_bytes: int
    matmul_sizes: tuple[int, ...]


def sparse_cases(args: argparse.Namespace, v32: V32Sparse) -> list[SparseCase]:
    shapes = (v32.index_heads, v32.index_dim, v32.topk, v32.heads, v32.dim, v32.dim_v)
    if args.tiny:
        # a partial last page: the logits hold -inf past each sequence
        return [SparseCase(2, 120, 16, v32.index_dim, 64, 16, v32.dim, v32.dim_v)]
    batches, contexts = ((64,), (16384,)) if args.quick else ((64, 128), (4096, 16384))
    return [SparseCase(b, ctx, *shapes) for b in batches for ctx in contexts]


def make_plan(args: argparse.Namespace, v3: V3, v32: V32Sparse) -> Plan:
    quick = args.quick
    mla = [
        MlaCase(batch, heads, s_q, args.ctx, v3.kv_dim, v3.kv_lora_rank)
        for heads in (16, v3.heads)
        for batch in (64, 128)
        for s_q in (1, 2)
        if batch in args.mla_batches and s_q in args.mla_s_q and heads in args.mla_heads
    ]
    projections = projection_shapes(v3)
    if quick:
        keep = {"q_b_proj", "kv_a_proj_with_mqa", "q_a + kv_a stacked", "o_proj", "dense down_proj"}
        projections = [p for p in projections if p[0] in keep]
    gemm_rows = (128, 4096) if quick else (64, 128, 4096)
    gemm = [GemmCase(name, m, n, k) for name, n, k in projections for m in gemm_rows]
    tokens = (32, 256) if quick else (32, 128, 256, 512)
    weights = (("w13", 2 * v3.moe_intermediate, v3.hidden), ("w2", v3.hidden, v3.moe_intermediate))
    grouped = [
        GroupedCase(
            layout, name, args.experts, t, n, k, args.contiguous_align if layout == "contiguous" else 128
        )
        for layout in ("contiguous", "masked")
        for name, n, k in weights
        for t in tokens
    ]
    gate_tokens = (1, 128, 4096, 16384) if quick else (1, 16, 128, 1024, 4096, 16384)
    gate = [GateCase(t, v3.experts, v3.n_group, v3.topk_group, v3.top_k) for t in gate_tokens]
    copy_bytes, matmul_sizes = (
        ((512 << 20) if quick else (1 << 30)),
        ((8192,) if quick else (4096, 8192, 16384)),
    )
    if args.tiny:  # the plumbing at interpreter-sized shapes
        mla = [MlaCase(2, 16, s_q, 128, v3.kv_dim, v3.kv_lora_rank) for s_q in (1, 2)]
        gemm = [GemmCase("tiny", 16, 256, 256)]
        grouped = [
            GroupedCase(
                layout, "tiny", 2, 16, 256, 256, args.contiguous_align if layout == "contiguous" else 32
            )
            for layout in ("contiguous", "masked")
        ]
        gate = [GateCase(16, v3.experts, v3.n_group, v3.topk_group, v3.top_k)]
        copy_bytes, matmul_sizes = 8 << 20, (256,)
    only = set(args.only)
    return Plan(
        mla=mla if "mla" in only else [],
        gemm=gemm if "gemm" in only else [],
        grouped=grouped if "grouped" in only else [],
        gate=gate if "gate" in only else [],
        sparse=sparse_cases(args, v32) if "sparse" in only else [],
        copy_bytes=copy_bytes,
        matmul_sizes=matmul_sizes,
    )


# ---------------------------------------------------------------------------------------- output


def fmt(value: Any, spec: str = ".3g") -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return format(value, spec)
    return str(value)


def pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def table(title: str, headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = [
        f"\n## {title}\n",
        "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |",
    ]
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _mb(nbytes: float) -> str:
    return fmt(nbytes / 1e6, ".1f")


def _work(flops: int, nbytes: int, digits: str = ".2f") -> list[str]:
    """GFLOP and FLOP per byte."""
    return [fmt(flops / 1e9, digits), fmt(flops / nbytes, ".0f")]


def print_plan(plan: Plan, v3: V3) -> None:
    """The cases with their FLOPs and bytes; needs no GPU."""
    print(f"DeepSeek-V3 shapes from {CONFIG.relative_to(ROOT)}; softmax scale {v3.softmax_scale:.6f}")
    print(f"sparse (V3.2) shapes from {CONFIG_V32.relative_to(ROOT)}")
    print(f"ceilings: copy {plan.copy_bytes >> 20} MiB buffers; bf16/fp8 matmul at n = {plan.matmul_sizes}")
    mla = [
        [c.name, _mb(c.cache_bytes), _mb(c.total_bytes), *_work(c.flops, c.total_bytes, ".1f")]
        for c in plan.mla
    ]
    gemm = [[c.name, str(c.m), str(c.n), str(c.k), _mb(c.bytes), *_work(c.flops, c.bytes)] for c in plan.gemm]
    grouped = [
        [c.name, str(c.n), str(c.k), str(c.rows_per_expert), _mb(c.bytes), *_work(c.flops, c.bytes)]
        for c in plan.grouped
    ]
    gate = [
        [c.name, str(c.n_group), str(c.topk_group), str(c.top_k), fmt(c.bytes / 1e6, ".3f")]
        for c in plan.gate
    ]
    sparse = [
        [c.name, f"{c.index_heads} x {c.index_dim}", _mb(c.key_bytes), _mb(c.logits_bytes), _mb(c.sparse_bytes),
         *_work(c.sparse_flops, c.sparse_bytes, ".1f")]
        for c in plan.sparse
    ]  # fmt: skip
    work = ["GFLOP", "FLOP/byte"]
    for title, headers, rows in (
        ("mla_decode (bf16 latent cache, page 64, causal)", ["case", "cache MB", "total MB", *work], mla),
        ("fp8_gemm_nt (block-FP8 dense)", ["projection", "m", "n", "k", "MB", *work], gemm),
        ("grouped FP8 GEMMs", ["case", "n", "k", "rows/expert in A", "MB", *work], grouped),
        ("moe_gate (fp32 logits, noaux_tc)", ["case", "n_group", "topk_group", "top_k", "MB"], gate),
        (
            "sparse (V3.2: indexer logits over FP8 keys, page 64; sparse MLA over the picked slots)",
            ["case", "index heads x dim", "keys MB", "logits MB", "sparse MLA MB", *work],
            sparse,
        ),
    ):
        print(table(title, headers, rows))


# ---------------------------------------------------------------------------------------- timing


def guarded(
    kind: str, name: str, errors: list[dict[str, str]], fn: Callable[[], dict[str, Any]]
) -> dict[str, Any]:
    """Run one case; an exception (compile error, OOM, wrong shapes) is recorded, not fatal."""
    try:
        return fn()
    except Exception as exc:
        log(f"  {kind} {name}: {type(exc).__name__}: {exc}")
        errors.append(
            {
                "section": kind,
                "case": name,
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(limit=6),
            }
        )
        return {"case": name, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        free_memory()


def try_entry(name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """One measurement beside a case's main one: an exception becomes this entry's error."""
    try:
        return fn()
    except Exception as exc:
        log(f"    {name}: {type(exc).__name__}: {exc}")
        return {"error": f"{type(exc).__name__}: {str(exc)[:1000]}"}


def entry_errors(section: str, record: dict[str, Any], keys: tuple[str, ...]) -> list[dict[str, str]]:
    """The errors of a case's entries named in ``keys``."""
    return [
        {"section": section, "case": f"{record.get('case')} {key}", "error": record[key]["error"]}
        for key in keys
        if isinstance(record.get(key), dict) and "error" in record[key]
    ]


# -------------------------------------------------------------------------------------- libraries


def library_version(module: ModuleType, name: str) -> str | None:
    version = getattr(module, "__version__", None)
    if version:
        return str(version)
    for dist in (name, name.replace("_", "-")):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def import_libraries(device: torch.device, skip: bool) -> tuple[dict[str, ModuleType], dict[str, Any]]:
    """(modules that imported, what each library is or why it is absent), each imported once, only
    on a CUDA device of the compute capability dsinfer's adapters take."""
    from dsinfer.ops.backend import capability_unsupported

    modules: dict[str, ModuleType] = {}
    info: dict[str, Any] = {}
    for name, backend in LIBRARIES.items():
        if skip:
            info[name] = {"absent": "--no-libraries"}
            continue
        if device.type != "cuda":
            info[name] = {"absent": "needs a CUDA device"}
            continue
        why = capability_unsupported(backend, torch.cuda.get_device_capability(device))
        if why is not None:
            info[name] = {"absent": why}
            continue
        try:
            module = importlib.import_module(name)
        except Exception as exc:  # not built here, or built against another torch/CUDA
            info[name] = {"absent": f"{type(exc).__name__}: {str(exc)[:500]}"}
            continue
        modules[name] = module
        info[name] = {"version": library_version(module, name), "file": getattr(module, "__file__", None)}
        log(f"  {name} {info[name]['version']} from {info[name]['file']}")
    for name, value in info.items():
        if "absent" in value:
            log(f"  {name}: absent ({value['absent']})")
    return modules, info


# -------------------------------------------------------------------------------------- ceilings


class Run(NamedTuple):
    """What every kernel section measures with: dsinfer's kernels and their Ops GEMM adapter,
    the libraries that imported, the ceilings, the timer and the arguments."""

    kernels: ModuleType
    adapter: Any
    libs: dict[str, ModuleType]
    ceil: dict[str, Any]
    timer: Timer
    args: argparse.Namespace


def measure_ceilings(plan: Plan, timer: Timer) -> dict[str, Any]:
    res: dict[str, Any] = {}
    n = plan.copy_bytes // 4
    device = timer.device
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    t = timer(lambda src=src, dst=dst: dst.copy_(src), flush=False)
    res["copy"] = {
        "buffer_bytes": plan.copy_bytes,
        "bytes_moved": 2 * plan.copy_bytes,
        **t,
        "tb_per_s": 2 * plan.copy_bytes / (t["median_us"] * 1e-6) / 1e12,
    }
    del src, dst
    free_memory()
    log(f"  copy: {res['copy']['tb_per_s']:.3f} TB/s (read + write)")

    res["bf16_matmul"] = []
    for size in plan.matmul_sizes:
        a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
        b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
        c = torch.empty_like(a)
        t = timer(lambda a=a, b=b, c=c: torch.mm(a, b, out=c), flush=False)
        rate = 2 * size**3 / (t["median_us"] * 1e-6) / 1e12
        res["bf16_matmul"].append({"n": size, **t, "tflops": rate})
        log(f"  bf16 matmul n={size}: {rate:.1f} TFLOP/s")
        del a, b, c
        free_memory()

    res["fp8_matmul"] = []
    if timer.cuda and has_fp8(device) and hasattr(torch, "_scaled_mm"):
        one = torch.ones((), device=device, dtype=torch.float32)
        for size in plan.matmul_sizes:
            a = torch.randn(size, size, device=device, dtype=torch.bfloat16).to(torch.float8_e4m3fn)
            bt = torch.randn(size, size, device=device, dtype=torch.bfloat16).to(torch.float8_e4m3fn)
            for fast in (True, False):
                try:
                    t = timer(lambda a=a, bt=bt, fast=fast: scaled_mm(a, bt.t(), one, fast), flush=False)
                except Exception as exc:  # an unsupported combination on this torch/cuBLAS
                    res["fp8_matmul"].append({"n": size, "fast_accum": fast, "error": repr(exc)})
                    continue
                rate = 2 * size**3 / (t["median_us"] * 1e-6) / 1e12
                res["fp8_matmul"].append({"n": size, "fast_accum": fast, **t, "tflops": rate})
                log(f"  fp8 _scaled_mm n={size} fast_accum={fast}: {rate:.1f} TFLOP/s")
            del a, bt
            free_memory()

    res["copy_tb_per_s"] = res["copy"]["tb_per_s"]
    res["bf16_tflops"] = max(r["tflops"] for r in res["bf16_matmul"])
    fp8_rates = [r["tflops"] for r in res["fp8_matmul"] if "tflops" in r]
    if fp8_rates:
        res["fp8_tflops"], res["fp8_source"] = max(fp8_rates), "torch._scaled_mm, per-tensor scales"
    else:
        res["fp8_tflops"], res["fp8_source"] = 2 * res["bf16_tflops"], "2x bf16 (no usable torch._scaled_mm)"
    return res


def roofline(flops: int, nbytes: int, time_us: float, tflops: float, tb_per_s: float) -> dict[str, float]:
    """Achieved rates and the fraction of the roofline bound (bound time / measured time)."""
    s = time_us * 1e-6
    t_compute, t_memory = flops / (tflops * 1e12), nbytes / (tb_per_s * 1e12)
    return {
        "tflops": flops / s / 1e12,
        "tb_per_s": nbytes / s / 1e12,
        "bound": "compute" if t_compute >= t_memory else "memory",
        "roofline_fraction": max(t_compute, t_memory) / s,
    }


# -------------------------------------------------------------------------------------- sections


MLA_OUT_TOL = 2e-2  # bf16 out: P is rounded to bf16 for P V in the kernels
MLA_LSE_TOL = 1e-3  # lse from fp32 sums of exact products


def mla_check(
    got: tuple[torch.Tensor, torch.Tensor], ref: tuple[torch.Tensor, torch.Tensor]
) -> dict[str, Any]:
    out_err, lse_err = rel_err(got[0], ref[0]), max_abs_err(got[1], ref[1])
    return {
        "out_rel_err": out_err,
        "lse_max_abs_err": lse_err,
        "ok": out_err <= MLA_OUT_TOL and lse_err <= MLA_LSE_TOL,
    }


def mla_rates(case: MlaCase, t_us: float, ceil: dict[str, Any]) -> dict[str, Any]:
    """The roofline fields of one time, and the latent cache's bytes/s against the copy bandwidth."""
    rates: dict[str, Any] = roofline(
        case.flops, case.total_bytes, t_us, ceil["bf16_tflops"], ceil["copy_tb_per_s"]
    )
    rates["cache_tb_per_s"] = case.cache_bytes / (t_us * 1e-6) / 1e12
    rates["cache_fraction_of_copy"] = rates["cache_tb_per_s"] / ceil["copy_tb_per_s"]
    return rates


def mla_sms(timer: Timer, mla_mod: ModuleType) -> int:
    """The SM count mla_decode_split_kv assumes on this device."""
    if timer.cuda:
        return torch.cuda.get_device_properties(timer.device).multi_processor_count
    return int(mla_mod.CPU_SMS)


def with_splits(
    mla_mod: ModuleType, launch: Any, batch: int, rows: int, max_keys: int, num_sms: int
) -> dict[str, Any]:
    """``launch`` (an ``MlaLaunch``) as mla_decode_split_kv's keywords, with the split count that
    function picks for it: the TMA kernel's programs count its channel parts, fewer per SM."""
    row_blocks = -(-rows // launch.block_m)
    per_sm = mla_mod.TMA_PROGRAMS_PER_SM if launch.kernel == "tma" else mla_mod.PROGRAMS_PER_SM
    splits = mla_mod.choose_num_splits(
        batch, row_blocks * launch.dv_parts, max_keys, num_sms, launch.block_n, per_sm
    )
    return {**launch._asdict(), "num_splits": splits}


def mla_split_entry(
    mla_mod: ModuleType,
    call: tuple[Any, ...],
    cfg: dict[str, Any],
    case: MlaCase,
    ceil: dict[str, Any],
    timer: Timer,
    ref: tuple[torch.Tensor, torch.Tensor] | None,
) -> dict[str, Any]:
    """mla_decode_split_kv at one launch: time, roofline fields, check."""
    res: dict[str, Any] = {"launch": cfg, **timer(lambda: mla_mod.mla_decode_split_kv(*call, **cfg))}
    res.update(mla_rates(case, res["median_us"], ceil))
    if ref is not None:
        res["check"] = mla_check(mla_mod.mla_decode_split_kv(*call, **cfg), ref)
    return res


def flashmla_entry(
    flash_mla: ModuleType,
    kernels: ModuleType,
    call: tuple[Any, ...],
    case: MlaCase,
    ceil: dict[str, Any],
    timer: Timer,
    ref: tuple[torch.Tensor, torch.Tensor] | None,
) -> dict[str, Any]:
    """FlashMLA through dsinfer's adapter, the model's path: its metadata is made for a new
    ``cache_seqlens`` tensor and reused while the same one comes back (the layers of one step), so
    the timed calls, passing one lengths tensor, reuse the first call's."""
    from dsinfer.ops.external import FlashMlaAdapter

    adapter = FlashMlaAdapter(flash_mla, fallback=kernels.mla_decode)
    res: dict[str, Any] = {"api": adapter.api, **timer(lambda: adapter.mla_decode(*call))}
    res.update(mla_rates(case, res["median_us"], ceil))
    if ref is not None:
        res["check"] = mla_check(adapter.mla_decode(*call), ref)
    res["metadata_builds"] = adapter.metadata_builds  # 0: the adapter sent the call to its fallback
    return res


def bench_mla(case: MlaCase, v3: V3, run: Run) -> dict[str, Any]:
    kernels, _, libs, ceil, timer, args = run
    from dsinfer.ops import mla as torch_mla

    # The submodules, for their launch heuristics (the package attribute mla_decode is the function).
    mla_mod = importlib.import_module(kernels.__name__ + ".mla_decode")
    tma_mod = importlib.import_module(kernels.__name__ + ".mla_decode_tma")
    device = timer.device
    g = gen(device)
    pages = -(-case.ctx // PAGE_SIZE)
    num_blocks = case.batch * pages
    k_cache = torch.randn(
        num_blocks, PAGE_SIZE, 1, case.dim, device=device, dtype=torch.bfloat16, generator=g
    )
    q = torch.randn(
        case.batch, case.s_q, case.heads, case.dim, device=device, dtype=torch.bfloat16, generator=g
    )
    # A real pool hands out pages in no order: scatter each sequence's pages over the whole cache.
    block_table = (
        torch.randperm(num_blocks, device=device, generator=g).to(torch.int32).view(case.batch, pages)
    )
    lens = torch.full((case.batch,), case.ctx, dtype=torch.int32, device=device)
    call = (q, k_cache, block_table, lens, case.dim_v, v3.softmax_scale, True)

    rows = case.s_q * case.heads
    num_sms = mla_sms(timer, mla_mod)

    def launch_cfg(launch: Any) -> dict[str, Any]:
        return with_splits(mla_mod, launch, case.batch, rows, pages * PAGE_SIZE, num_sms)

    launch = mla_mod.default_launch(rows, torch.bfloat16)
    fallback = None
    if launch.kernel == "tma":
        fallback = tma_mod.tma_unsupported(q, k_cache, case.dim_v, launch.block_n, launch.dv_parts)
        if fallback is not None:
            launch = mla_mod.pointer_fallback(launch)
    res: dict[str, Any] = {
        "case": case.name,
        **asdict(case),
        "cache_bytes": case.cache_bytes,
        "total_bytes": case.total_bytes,
        "flops": case.flops,
        "launch": {**launch_cfg(launch), "row_blocks": -(-rows // launch.block_m), "tma_fallback": fallback},
    }

    t = timer(lambda: kernels.mla_decode(*call))
    t_us = t["median_us"]
    res["triton"] = t
    res.update(mla_rates(case, t_us, ceil))
    if case.heads <= 16:
        res["target"] = f"latent-cache bytes/s > {TARGET_MLA_MEMORY:.0%} of copy bandwidth"
        res["target_met"] = res["cache_fraction_of_copy"] > TARGET_MLA_MEMORY
    else:
        res["target"] = f"> {TARGET_MLA_ROOFLINE:.0%} of the roofline bound"
        res["target_met"] = res["roofline_fraction"] > TARGET_MLA_ROOFLINE

    ref = None if args.no_check else torch_mla.mla_decode(*call)
    if ref is not None:
        res["check"] = mla_check(kernels.mla_decode(*call), ref)
    if not args.no_torch:
        res["torch"] = timer(lambda: torch_mla.mla_decode(*call))
        res["speedup"] = res["torch"]["median_us"] / t_us
    if launch.kernel == "tma":  # the kernel it replaced, at its fallback launch: before and after
        pointer = launch_cfg(mla_mod.pointer_fallback(launch))
        res["triton_pointer"] = try_entry(
            "pointer kernel", lambda: mla_split_entry(mla_mod, call, pointer, case, ceil, timer, ref)
        )
    if "flash_mla" in libs:
        res["flashmla"] = try_entry(
            "FlashMLA", lambda: flashmla_entry(libs["flash_mla"], kernels, call, case, ceil, timer, ref)
        )
    if args.sweep_mla:
        configs = mla_sweep_configs(mla_mod, rows, launch_cfg)
        if args.tiny:  # the interpreter's plumbing run: a few launches of each kind
            configs = configs[::4]
        res["sweep"] = sweep_mla(case, mla_mod, call, configs, timer)
    return res


def mla_sweep_configs(
    mla_mod: ModuleType, rows: int, launch_cfg: Callable[[Any], dict[str, Any]]
) -> list[dict[str, Any]]:
    """mla_decode_split_kv keywords around the defaults; fewer than 25, since on a GPU each new
    one is a compilation. 16 rows leave out 8 warps with 3 stages: the H100 sweep
    (benchmarks/results/gpu_h100_2026-11-26/run3_sweep_mla.json) timed them within 1% of 2."""
    launch = mla_mod.MlaLaunch

    def at(lau: Any, splits: int) -> dict[str, Any]:
        return {**lau._asdict(), "num_splits": splits}

    if rows <= 16:
        s = launch_cfg(mla_mod.default_launch(rows, torch.bfloat16))["num_splits"]
        pointer = [
            at(launch(16, block_n, warps, stages, "pointer", 1), ns)
            for block_n in (32, 64)
            for warps, stages in ((4, 2), (4, 3), (8, 2))
            for ns in sorted({max(1, s // 2), s, 2 * s})
        ]
        # wgmma wants 64-row blocks: the 16 rows padded, in one or two channel parts
        return pointer + [launch_cfg(launch(64, 32, 8, 2, "tma", parts)) for parts in (1, 2)]
    tma_splits = launch_cfg(launch(64, 32, 8, 2, "tma", 2))["num_splits"]
    splits = sorted({1, 2, 4, tma_splits})
    configs = [
        at(launch(64, block_n, 8, stages, "tma", 2), ns)
        for block_n in (32, 64)
        for stages in (2, 3)
        for ns in splits
    ]
    # one program per row block (scores once, two 64 x 256 accumulators): its registers decide
    configs += [
        at(launch(64, block_n, 8, stages, "tma", 1), ns)
        for block_n, stages in ((32, 2), (32, 3), (64, 2))
        for ns in (1, 2)
    ]
    # one warpgroup, one stage: 106 KB of shared memory, so two programs share an SM and one's
    # softmax runs under the other's wgmma (the offline sm_90a build spills 168 bytes)
    configs += [at(launch(64, 32, 4, 1, "tma", 2), ns) for ns in (1, 2)]
    pointer = launch(32, 32, 8, 2, "pointer", 1)
    configs += [at(pointer, ns) for ns in sorted({launch_cfg(pointer)["num_splits"], tma_splits})]
    return configs


def sweep_mla(
    case: MlaCase, mla_mod: ModuleType, call: tuple[Any, ...], configs: list[dict[str, Any]], timer: Timer
) -> list[dict[str, Any]]:
    """Kernel time at each launch of ``configs``, best first; a launch that fails is recorded."""
    results = []
    for cfg in configs:
        try:
            t = timer(lambda cfg=cfg: mla_mod.mla_decode_split_kv(*call, **cfg))
        except Exception as exc:  # out of shared memory / registers: not a candidate
            results.append({**cfg, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
            continue
        us = t["median_us"]
        results.append({**cfg, "median_us": us, "cache_tb_per_s": case.cache_bytes / (us * 1e-6) / 1e12})
    results.sort(key=lambda r: r.get("median_us", math.inf))
    if results and "median_us" in results[0]:
        log(f"    sweep best: {results[0]}")
    return results


def gemm_entry(
    fn: Callable[..., torch.Tensor],
    flops: int,
    nbytes: int,
    run: Run,
    expected: torch.Tensor | None,
    pick: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
    deep_gemm: ModuleType | None = None,
) -> dict[str, Any]:
    """One GEMM path (``fn`` returns its output): time, rates against the fp8 rate, check. With
    ``deep_gemm``: ``fn(adapter)`` through dsinfer's DeepGEMM adapter, what the model calls (bf16
    in and out, quantization and layout included)."""
    call, extra = fn, {}
    if deep_gemm is not None:
        from dsinfer.ops.external import DeepGemmAdapter

        adapter = DeepGemmAdapter(deep_gemm)
        call, extra = (lambda: fn(adapter)), {"m_alignment": adapter.m_alignment}
    t = run.timer(call)
    fp8 = run.ceil["fp8_tflops"]
    res: dict[str, Any] = {
        **extra,
        **t,
        **roofline(flops, nbytes, t["median_us"], fp8, run.ceil["copy_tb_per_s"]),
    }
    res["fraction_of_fp8"] = res["tflops"] / fp8
    if expected is not None:
        err = rel_err(pick(call()), expected)
        res["check"] = {"rel_err": err, "ok": err <= GEMM_TOL}
    return res


def bench_gemm(case: GemmCase, run: Run) -> dict[str, Any]:
    kernels, adapter, libs, ceil, timer, args = run
    from dsinfer.ops import gemm as torch_gemm

    device = timer.device
    g = gen(device)
    x = torch.randn(case.m, case.k, device=device, dtype=torch.bfloat16, generator=g)
    w, ws = fp8_weights(g, (), case.n, case.k)
    qa, sa = kernels.quantize_activation_1x128(x)
    d = torch.empty(case.m, case.n, device=device, dtype=torch.bfloat16)
    res: dict[str, Any] = {
        "case": f"{case.name} m{case.m}",
        **asdict(case),
        "flops": case.flops,
        "bytes": case.bytes,
    }

    t = timer(lambda: kernels.fp8_gemm_nt((qa, sa), (w, ws), d))
    res["triton"] = t
    res.update(roofline(case.flops, case.bytes, t["median_us"], ceil["fp8_tflops"], ceil["copy_tb_per_s"]))
    res["fraction_of_fp8"] = res["tflops"] / ceil["fp8_tflops"]
    res["quantize"] = timer(lambda: kernels.quantize_activation_1x128(x))
    res["ops_triton"] = timer(lambda: adapter.linear(x, w, ws))  # what the model calls: bf16 in, bf16 out
    if timer.cuda and hasattr(torch, "_scaled_mm") and case.m % 16 == 0 and case.n % 16 == 0:
        one = torch.ones((), device=device, dtype=torch.float32)
        try:  # cuBLAS at the same shape with one scale per tensor: not the same numerics, a yardstick
            res["cublas_fp8_per_tensor"] = timer(lambda: scaled_mm(qa, w.t(), one, True))
        except Exception as exc:
            res["cublas_fp8_per_tensor"] = {"error": repr(exc)}
    ref = None if args.no_check else torch_gemm.linear(x, w, ws)
    if ref is not None:
        kernels.fp8_gemm_nt((qa, sa), (w, ws), d)
        err = rel_err(d, ref)
        res["check"] = {
            "rel_err": err,
            "ops_rel_err": rel_err(adapter.linear(x, w, ws), ref),
            "ok": err <= GEMM_TOL,
        }
    if not args.no_torch:
        res["torch"] = timer(lambda: torch_gemm.linear(x, w, ws))
        res["speedup"] = res["torch"]["median_us"] / res["ops_triton"]["median_us"]
    if "deep_gemm" in libs:
        dg = libs["deep_gemm"]
        out = torch.empty_like(d)

        def raw() -> torch.Tensor:
            dg.fp8_gemm_nt((qa, sa), (w, ws), out)  # the Triton kernel's operands: fp32 1x128 scales
            return out

        res["deepgemm"] = try_entry(
            "DeepGEMM fp8_gemm_nt", lambda: gemm_entry(raw, case.flops, case.bytes, run, ref)
        )
        res["ops_deepgemm"] = try_entry(
            "DeepGEMM adapter",
            lambda: gemm_entry(lambda a: a.linear(x, w, ws), case.flops, case.bytes, run, ref, deep_gemm=dg),
        )
    return res


def bench_grouped(case: GroupedCase, run: Run) -> dict[str, Any]:
    kernels, adapter, libs, ceil, timer, args = run
    from dsinfer.ops import gemm as torch_gemm

    device = timer.device
    g = gen(device)
    e, rows = case.experts, case.rows_per_expert
    w, ws = fp8_weights(g, (e,), case.n, case.k)
    res: dict[str, Any] = {"case": case.name, **asdict(case), "flops": case.flops, "bytes": case.bytes}
    if case.layout == "contiguous":
        # Expert segments in order; each padded with -1 rows to a multiple of `align` (1 = no padding:
        # what dsinfer's MoE layer feeds; 128 = DeepGEMM's contiguous layout).
        idx = torch.full((e, rows), -1, dtype=torch.int32, device=device)
        idx[:, : case.tokens] = torch.arange(e, dtype=torch.int32, device=device)[:, None]
        m_indices = idx.flatten()
        valid = m_indices >= 0
        x = torch.randn(e * rows, case.k, device=device, dtype=torch.bfloat16, generator=g)
        qa, sa = kernels.quantize_activation_1x128(x)
        d = torch.zeros(e * rows, case.n, device=device, dtype=torch.bfloat16)

        def kernel() -> None:
            kernels.m_grouped_fp8_gemm_nt_contiguous((qa, sa), (w, ws), d, m_indices)

        def ops() -> torch.Tensor:
            return adapter.grouped_gemm_contiguous(x, w, ws, m_indices)

        def ref() -> torch.Tensor:
            return torch_gemm.grouped_gemm_contiguous(x, w, ws, m_indices)

        def pick(t: torch.Tensor) -> torch.Tensor:
            return t[valid]

        def library(dg: ModuleType, out: torch.Tensor) -> None:
            dg.m_grouped_fp8_gemm_nt_contiguous((qa, sa), (w, ws), out, m_indices)

        def library_ops(a: Any) -> torch.Tensor:
            return a.grouped_gemm_contiguous(x, w, ws, m_indices)
    else:
        # DeepEP low-latency layout: [E, m_max, k], the first masked_m[e] rows valid.
        x = torch.randn(e, rows, case.k, device=device, dtype=torch.bfloat16, generator=g)
        masked_m = torch.full((e,), case.tokens, dtype=torch.int32, device=device)
        qa, sa = kernels.quantize_activation_1x128(x)
        d = torch.zeros(e, rows, case.n, device=device, dtype=torch.bfloat16)

        def kernel() -> None:
            kernels.m_grouped_fp8_gemm_nt_masked((qa, sa), (w, ws), d, masked_m, case.tokens)

        def ops() -> torch.Tensor:
            return adapter.grouped_gemm_masked(x, w, ws, masked_m, case.tokens)

        def ref() -> torch.Tensor:
            return torch_gemm.grouped_gemm_masked(x, w, ws, masked_m, case.tokens)

        def pick(t: torch.Tensor) -> torch.Tensor:
            return t[:, : case.tokens]

        def library(dg: ModuleType, out: torch.Tensor) -> None:
            dg.m_grouped_fp8_gemm_nt_masked((qa, sa), (w, ws), out, masked_m, case.tokens)

        def library_ops(a: Any) -> torch.Tensor:
            return a.grouped_gemm_masked(x, w, ws, masked_m, case.tokens)

    t = timer(kernel)
    res["triton"] = t
    res.update(roofline(case.flops, case.bytes, t["median_us"], ceil["fp8_tflops"], ceil["copy_tb_per_s"]))
    res["fraction_of_fp8"] = res["tflops"] / ceil["fp8_tflops"]
    if case.tokens >= TARGET_GROUPED_MIN_TOKENS:
        res["target"] = f"> {TARGET_GROUPED_FP8:.0%} of the fp8 matmul rate"
        res["target_met"] = res["fraction_of_fp8"] > TARGET_GROUPED_FP8
    res["ops_triton"] = timer(ops)
    expected = None if args.no_check else pick(ref())
    if expected is not None:
        kernel()
        err = rel_err(pick(d), expected)
        res["check"] = {"rel_err": err, "ops_rel_err": rel_err(pick(ops()), expected), "ok": err <= GEMM_TOL}
    if not args.no_torch:
        res["torch"] = timer(ref)
        res["speedup"] = res["torch"]["median_us"] / res["ops_triton"]["median_us"]
    if "deep_gemm" in libs:
        dg = libs["deep_gemm"]

        def raw_entry() -> dict[str, Any]:
            from dsinfer.ops.external import DeepGemmAdapter

            align = DeepGemmAdapter(dg).m_alignment
            if case.layout == "contiguous" and rows % align:
                return {"skipped": f"{rows}-row expert segments are not multiples of DeepGEMM's {align}"}
            out = torch.zeros_like(d)

            def fn() -> torch.Tensor:
                library(dg, out)
                return out

            return gemm_entry(fn, case.flops, case.bytes, run, expected, pick)

        res["deepgemm"] = try_entry("DeepGEMM grouped GEMM", raw_entry)
        res["ops_deepgemm"] = try_entry(
            "DeepGEMM adapter",
            lambda: gemm_entry(library_ops, case.flops, case.bytes, run, expected, pick, deep_gemm=dg),
        )
    return res


def bench_gate(case: GateCase, v3: V3, run: Run) -> dict[str, Any]:
    kernels, _, _, _, timer, args = run
    from dsinfer.ops import gate as torch_gate

    device = timer.device
    g = gen(device)
    logits = torch.randn(case.tokens, case.experts, device=device, generator=g)  # fp32, as the model's router
    bias = torch.randn(case.experts, device=device, generator=g) * 0.05
    call = (
        logits,
        bias,
        case.top_k,
        case.n_group,
        case.topk_group,
        v3.norm_topk_prob,
        v3.routed_scaling_factor,
    )
    res: dict[str, Any] = {"case": case.name, **asdict(case), "bytes": case.bytes}
    t = timer(lambda: kernels.moe_gate(*call))
    res["triton"] = t
    res["tokens_per_s"] = case.tokens / (t["median_us"] * 1e-6)
    res["gb_per_s"] = case.bytes / (t["median_us"] * 1e-6) / 1e9
    if not args.no_check:
        w, ids = kernels.moe_gate(*call)
        rw, rids = torch_gate.moe_gate(*call)
        # Same expert sets (the order of exact ties may differ); weights compared per expert id. A row
        # whose sets differ passes only as a near tie: the chosen experts' biased scores, sorted, agree
        # within 1e-5 (the kernel's sigmoid and the reference's differ by a few ulp).
        sids, order = ids.sort(dim=1)
        rsids, rorder = rids.sort(dim=1)
        same = (sids == rsids).all(dim=1)
        werr = (
            (w.gather(1, order) - rw.gather(1, rorder))[same].abs().max().item() if bool(same.any()) else 0.0
        )
        choice = logits.sigmoid() + bias
        gap = (choice.gather(1, ids).sort(dim=1).values - choice.gather(1, rids).sort(dim=1).values).abs()
        near_tie = gap.amax(dim=1) <= 1e-5
        res["check"] = {
            "rows_with_other_experts": int((~same).sum()),
            "rows_not_near_tie": int((~same & ~near_tie).sum()),
            "weights_max_abs_err": werr,
            "ok": not bool((~same & ~near_tie).any()) and werr <= 1e-5,
        }
    if not args.no_torch:
        res["torch"] = timer(lambda: torch_gate.moe_gate(*call))
        res["speedup"] = res["torch"]["median_us"] / t["median_us"]
    return res


INDEXER_TOL = 1e-2  # max |diff| / max |ref| over the finite logits (fp32 products of e4m3 values)


def logits_check(got: torch.Tensor, ref: torch.Tensor) -> dict[str, Any]:
    """Finite logits within INDEXER_TOL of max |ref|; non-finite exactly where the reference's are."""
    finite = torch.isfinite(ref)
    same = got.shape == ref.shape and bool(torch.equal(finite, torch.isfinite(got)))
    err = rel_err(got[finite], ref[finite]) if same else float("nan")
    return {"rel_err": err, "inf_pattern_equal": same, "ok": same and err <= INDEXER_TOL}


def picks_check(positions: torch.Tensor, ref_logits: torch.Tensor, topk: int) -> dict[str, Any]:
    """Top-k positions judged by the reference logits (rounding may swap keys of near-equal
    logits): as many valid and distinct picks per query as the reference has, whose reference
    logits, sorted, are the reference's top-k within INDEXER_TOL of max |ref|."""
    want = ref_logits.topk(min(topk, ref_logits.shape[-1]), dim=-1).values
    if positions.shape != want.shape:
        return {"shape": list(positions.shape), "expected_shape": list(want.shape), "ok": False}
    valid = positions >= 0
    counts_equal = bool(torch.equal(valid.sum(-1), torch.isfinite(want).sum(-1)))
    ordered = positions.sort(dim=-1).values
    distinct = not bool(((ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)).any())
    chosen = ref_logits.gather(-1, positions.long().clamp(min=0))
    chosen = torch.where(valid, chosen, float("-inf")).sort(dim=-1, descending=True).values
    finite = torch.isfinite(want)
    scale = ref_logits[torch.isfinite(ref_logits)].abs().max().item() if bool(finite.any()) else 1.0
    diff = (chosen[finite] - want[finite]).abs().max().item() if bool(finite.any()) else 0.0
    err = diff / (scale or 1.0) if counts_equal else float("nan")
    return {
        "rel_err": err,
        "counts_equal": counts_equal,
        "distinct": distinct,
        "ok": counts_equal and distinct and err <= INDEXER_TOL,
    }


def rates_of(flops: int, nbytes: int, t_us: float, ceil: dict[str, Any]) -> dict[str, Any]:
    return roofline(flops, nbytes, t_us, ceil["bf16_tflops"], ceil["copy_tb_per_s"])


def key_rates(case: SparseCase, t_us: float, ceil: dict[str, Any]) -> dict[str, Any]:
    """The FP8 index keys' bytes/s against the copy bandwidth."""
    tb = case.key_bytes / (t_us * 1e-6) / 1e12
    return {
        "key_tb_per_s": tb,
        "key_fraction_of_copy": tb / ceil["copy_tb_per_s"],
        "tflops": case.indexer_flops / (t_us * 1e-6) / 1e12,
    }


@dataclass
class SparseInputs:
    q8: torch.Tensor  # e4m3 [B, 1, index_heads, index_dim]
    weights: torch.Tensor  # fp32 [B, 1, index_heads], the query scales folded in
    index_cache: torch.Tensor  # uint8 [pages, 64, index_dim + 4]: DeepSeek's FP8 key layout
    table: torch.Tensor
    lens: torch.Tensor
    q: torch.Tensor  # bf16 [B, 1, heads, 576]
    kv: torch.Tensor  # bf16 [pages, 64, 1, 576]
    slots: torch.Tensor  # int32 [B, 1, topk]: distinct visible cache slots

    def indexer_args(self) -> tuple[torch.Tensor, ...]:
        return (self.q8, self.weights, self.index_cache, self.table, self.lens)


def sparse_inputs(case: SparseCase, device: torch.device) -> SparseInputs:
    from dsinfer.ops import indexer as ix

    g = gen(device)
    pages = -(-case.ctx // PAGE_SIZE)
    num_blocks = case.batch * pages
    table = torch.randperm(num_blocks, device=device, generator=g).to(torch.int32).view(case.batch, pages)
    lens = torch.full((case.batch,), case.ctx, dtype=torch.int32, device=device)
    index_cache = torch.zeros(
        num_blocks, PAGE_SIZE, case.index_dim + ix.SCALE_BYTES, dtype=torch.uint8, device=device
    )
    keys = torch.randn(num_blocks * PAGE_SIZE, case.index_dim, device=device, generator=g)
    ix.write_keys(index_cache, torch.arange(num_blocks * PAGE_SIZE, device=device), keys)
    del keys
    q_plain = torch.randn(case.batch, 1, case.index_heads, case.index_dim, device=device, generator=g)
    q8, q_scale = ix.quantize_per_row(q_plain)
    weights = torch.randn(case.batch, 1, case.index_heads, device=device, generator=g)
    weights = weights * q_scale * case.index_heads**-0.5
    kv = torch.randn(num_blocks, PAGE_SIZE, 1, case.dim, device=device, dtype=torch.bfloat16, generator=g)
    q = torch.randn(case.batch, 1, case.heads, case.dim, device=device, dtype=torch.bfloat16, generator=g)
    positions = torch.rand(case.batch, 1, case.ctx, device=device, generator=g).topk(case.picked).indices
    slots = ix.positions_to_slots(positions.to(torch.int32), table, PAGE_SIZE)
    return SparseInputs(q8, weights, index_cache, table, lens, q, kv, slots)


def indexer_entry(
    logits: Callable[..., torch.Tensor],
    inp: SparseInputs,
    case: SparseCase,
    run: Run,
    ref: torch.Tensor | None,
) -> dict[str, Any]:
    """The logits kernel: time, key bytes/s, check; the torch reference's time."""
    from dsinfer.ops import indexer as ix

    res: dict[str, Any] = dict(run.timer(lambda: logits(*inp.indexer_args())))
    res.update(key_rates(case, res["median_us"], run.ceil))
    if ref is not None:
        res["check"] = logits_check(logits(*inp.indexer_args()), ref)
    if not run.args.no_torch:
        res["torch"] = run.timer(lambda: ix.indexer_logits(*inp.indexer_args()))
    return res


def topk_entry(
    topk: Callable[..., torch.Tensor], inp: SparseInputs, case: SparseCase, run: Run, ref: torch.Tensor | None
) -> dict[str, Any]:
    """An ``indexer_topk`` entry point (logits and top-k): time, picks judged by the reference."""
    res: dict[str, Any] = dict(run.timer(lambda: topk(*inp.indexer_args(), case.topk)))
    if ref is not None:
        res["check"] = picks_check(topk(*inp.indexer_args(), case.topk), ref, case.topk)
    return res


def sparse_mla_entry(
    decode: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    inp: SparseInputs,
    case: SparseCase,
    scale: float,
    run: Run,
    ref: tuple[torch.Tensor, torch.Tensor] | None,
    with_torch: bool,
) -> dict[str, Any]:
    """A sparse MLA decode: time, roofline fields, check; the torch reference's time."""
    from dsinfer.ops import sparse_mla as torch_sparse

    call = (inp.q, inp.kv, inp.slots, case.dim_v, scale)
    res: dict[str, Any] = dict(run.timer(lambda: decode(*call)))
    res.update(rates_of(case.sparse_flops, case.sparse_bytes, res["median_us"], run.ceil))
    if ref is not None:
        res["check"] = mla_check(decode(*call), ref)
    if with_torch:
        res["torch"] = run.timer(lambda: torch_sparse.sparse_mla_decode(*call))
    return res


def bench_sparse(case: SparseCase, v32: V32Sparse, run: Run) -> dict[str, Any]:
    kernels, _, libs, _, timer, args = run
    from dsinfer.ops import indexer as ix
    from dsinfer.ops import sparse_mla as torch_sparse
    from dsinfer.ops.external_sparse import DeepGemmIndexerAdapter, FlashMlaSparseAdapter

    inp = sparse_inputs(case, timer.device)
    scale = v32.softmax_scale
    res: dict[str, Any] = {
        "case": case.name,
        **asdict(case),
        "key_bytes": case.key_bytes,
        "logits_bytes": case.logits_bytes,
        "indexer_flops": case.indexer_flops,
        "sparse_bytes": case.sparse_bytes,
        "sparse_flops": case.sparse_flops,
    }
    ref_logits = None if args.no_check else ix.indexer_logits(*inp.indexer_args())
    ref_mla = None
    if not args.no_check:
        ref_mla = torch_sparse.sparse_mla_decode(inp.q, inp.kv, inp.slots, case.dim_v, scale)
    res["indexer"] = try_entry(
        "Triton indexer_logits",
        lambda: indexer_entry(kernels.indexer_logits, inp, case, run, ref_logits),
    )
    res["indexer_topk"] = try_entry(
        "Triton indexer_topk",
        lambda: topk_entry(ix.indexer_topk_with(kernels.indexer_logits), inp, case, run, ref_logits),
    )
    res["sparse_mla"] = try_entry(
        "Triton sparse_mla_decode",
        lambda: sparse_mla_entry(
            kernels.sparse_mla_decode, inp, case, scale, run, ref_mla, not args.no_torch
        ),
    )
    if "deep_gemm" in libs:
        res["deepgemm"] = try_entry(
            "DeepGEMM indexer",
            lambda: topk_entry(
                DeepGemmIndexerAdapter(libs["deep_gemm"]).indexer_topk, inp, case, run, ref_logits
            ),
        )
    if "flash_mla" in libs:
        res["flashmla"] = try_entry(
            "FlashMLA sparse",
            lambda: sparse_mla_entry(
                FlashMlaSparseAdapter(libs["flash_mla"], device=timer.device).sparse_mla_decode,
                inp,
                case,
                scale,
                run,
                ref_mla,
                False,
            ),
        )
    oks = {
        key: res[key]["check"]["ok"]
        for key in ("indexer", "indexer_topk", "sparse_mla")
        if "check" in res[key]
    }
    if oks:
        res["check"] = {**oks, "ok": all(oks.values())}
    return res


# ----------------------------------------------------------------------------------------- tables


def us(e: dict[str, Any] | None, key: str = "median_us") -> str:
    if isinstance(e, dict) and "error" in e:
        return "ERR"
    if not e or key not in e:
        return "-"
    return fmt(e[key], ".1f")


def field(r: dict[str, Any], key: str, name: str) -> Any:
    """``r[key][name]`` when ``r[key]`` is a measured entry, else None."""
    e = r.get(key)
    return e.get(name) if isinstance(e, dict) else None


def check_str(r: dict[str, Any], keys: tuple[str, ...] = TRITON_ENTRIES, own: bool = True) -> str:
    """ok / MISMATCH over the case's own check (``own``) and those of its entries ``keys``."""
    checks = [r["check"]] if own and r.get("check") else []
    checks += [r[k]["check"] for k in keys if isinstance(r.get(k), dict) and r[k].get("check")]
    if not checks:
        return "-"
    return "ok" if all(c.get("ok") for c in checks) else "MISMATCH"


def library_check_str(r: dict[str, Any]) -> str:
    return check_str(r, LIBRARY_ENTRIES, own=False)


def library_status(info: dict[str, Any]) -> str:
    if "absent" in info:
        return f"absent: {info['absent']}"
    return f"{info.get('version')} ({info.get('file')})"


def kernel_str(launch: dict[str, Any]) -> str:
    kernel = str(launch.get("kernel", "-"))
    return f"{kernel} x{launch['dv_parts']}" if kernel == "tma" else kernel


Column = tuple[str, Callable[[dict[str, Any]], str]]

# Columns several tables share.
CASE: Column = ("case", lambda r: r["case"])
US: Column = ("us", lambda r: us(r["triton"]))
TFLOPS: Column = ("TFLOP/s", lambda r: fmt(r["tflops"], ".0f"))
OF_FP8: Column = ("of fp8", lambda r: pct(r["fraction_of_fp8"]))
OF_ROOFLINE: Column = ("of roofline", lambda r: pct(r["roofline_fraction"]))
TARGET: Column = ("target", lambda r: fmt(r.get("target_met")))
FLASHMLA: list[Column] = [
    ("FlashMLA us", lambda r: us(r.get("flashmla"))),
    ("FlashMLA of roofline", lambda r: pct(field(r, "flashmla", "roofline_fraction"))),
]
DEEPGEMM: list[Column] = [
    ("ops us", lambda r: us(r["ops_triton"])),
    ("DeepGEMM us", lambda r: us(r.get("deepgemm"))),
    ("DeepGEMM of fp8", lambda r: pct(field(r, "deepgemm", "fraction_of_fp8"))),
    ("DeepGEMM ops us", lambda r: us(r.get("ops_deepgemm"))),
]
TORCH: list[Column] = [
    ("torch us", lambda r: us(r.get("torch"))),
    ("speedup", lambda r: fmt(r.get("speedup"), ".1f")),
]
CHECKS: list[Column] = [("check", lambda r: check_str(r)), ("library check", library_check_str)]

MLA_COLUMNS: list[Column] = [
    CASE,
    ("kernel", lambda r: kernel_str(r["launch"])),
    ("splits", lambda r: str(r["launch"]["num_splits"])),
    US,
    ("cache TB/s", lambda r: fmt(r["cache_tb_per_s"], ".2f")),
    ("of copy", lambda r: pct(r["cache_fraction_of_copy"])),
    TFLOPS,
    OF_ROOFLINE,
    ("bound", lambda r: r["bound"]),
    TARGET,
    ("pointer us", lambda r: us(r.get("triton_pointer"))),
    *FLASHMLA,
    *TORCH,
    *CHECKS,
]
GEMM_COLUMNS: list[Column] = [
    CASE,
    ("n", lambda r: str(r["n"])),
    ("k", lambda r: str(r["k"])),
    US,
    TFLOPS,
    OF_FP8,
    OF_ROOFLINE,
    ("quant us", lambda r: us(r.get("quantize"))),
    ("cuBLAS us", lambda r: us(r.get("cublas_fp8_per_tensor"))),
    *DEEPGEMM,
    *TORCH,
    *CHECKS,
]
GROUPED_COLUMNS: list[Column] = [CASE, US, TFLOPS, OF_FP8, OF_ROOFLINE, TARGET, *DEEPGEMM, *TORCH, *CHECKS]
GATE_COLUMNS: list[Column] = [
    CASE,
    US,
    ("Mtok/s", lambda r: fmt(r["tokens_per_s"] / 1e6, ".2f")),
    *TORCH,
    CHECKS[0],
]
SPARSE_COLUMNS: list[Column] = [
    CASE,
    ("indexer us", lambda r: us(r.get("indexer"))),
    ("keys TB/s", lambda r: fmt(field(r, "indexer", "key_tb_per_s"), ".2f")),
    ("of copy", lambda r: pct(field(r, "indexer", "key_fraction_of_copy"))),
    ("topk us", lambda r: us(r.get("indexer_topk"))),
    ("DeepGEMM topk us", lambda r: us(r.get("deepgemm"))),
    ("sparse MLA us", lambda r: us(r.get("sparse_mla"))),
    ("TFLOP/s", lambda r: fmt(field(r, "sparse_mla", "tflops"), ".0f")),
    ("of roofline", lambda r: pct(field(r, "sparse_mla", "roofline_fraction"))),
    *FLASHMLA,
    ("torch indexer us", lambda r: us(field(r, "indexer", "torch"))),
    ("torch MLA us", lambda r: us(field(r, "sparse_mla", "torch"))),
    *CHECKS,
]


def records_table(title: str, columns: list[Column], records: list[dict[str, Any]]) -> str:
    rows = []
    for r in records:
        if "error" in r:
            rows.append([r["case"], "ERROR", *["-"] * (len(columns) - 2)])
        else:
            rows.append([get(r) for _, get in columns])
    return table(title, [h for h, _ in columns], rows)


def report(results: dict[str, Any]) -> str:
    ceil = results["ceilings"]
    parts = [f"# dsinfer.kernels on {results['meta']['device']} ({results['meta']['date']})"]
    if ceil:
        rows = [["copy (read + write)", f"{ceil['copy_tb_per_s']:.3f} TB/s", ""]]
        rows += [[f"bf16 torch.mm n={r['n']}", f"{r['tflops']:.1f} TFLOP/s", ""] for r in ceil["bf16_matmul"]]
        rows += [
            [
                f"fp8 _scaled_mm n={r['n']}",
                fmt(r.get("tflops"), ".1f") + " TFLOP/s",
                f"fast_accum={r['fast_accum']}",
            ]
            for r in ceil["fp8_matmul"]
        ]
        rows.append(["fp8 ceiling used", f"{ceil['fp8_tflops']:.1f} TFLOP/s", ceil["fp8_source"]])
        parts.append(table("ceilings", ["measure", "rate", "note"], rows))
    sections = [
        (
            "mla",
            MLA_COLUMNS,
            "mla_decode (bf16, page 64, causal); target: 16 heads: cache bytes/s > 80% of copy; "
            "128 heads: > 60% of roofline",
        ),
        (
            "dense_gemm",
            GEMM_COLUMNS,
            "fp8_gemm_nt: us = kernel on quantized operands; ops = the Ops linear over "
            "dsinfer.kernels (quantize + GEMM, bf16 in and out); speedup = torch / ops",
        ),
        (
            "grouped_gemm",
            GROUPED_COLUMNS,
            "grouped FP8 GEMMs (m = tokens per expert); target: > 60% of the fp8 "
            "rate at m >= 256; speedup = torch / ops",
        ),
        ("gate", GATE_COLUMNS, "moe_gate (fp32 logits, noaux_tc)"),
        (
            "sparse",
            SPARSE_COLUMNS,
            "sparse (V3.2): indexer_logits over the FP8 key cache (key bytes/s against copy); topk = "
            "the Ops indexer_topk over it (logits + torch top-k), as DeepGEMM's adapter; "
            "sparse_mla_decode over the picked slots (roofline)",
        ),
    ]
    libraries = results["meta"].get("libraries") or {}
    if libraries:
        parts.append(
            table(
                "libraries",
                ["module", "status"],
                [[name, library_status(info)] for name, info in libraries.items()],
            )
        )
    for key, columns, title in sections:
        if results.get(key):
            parts.append(records_table(title, columns, results[key]))
    for title, errors in (("ERRORS", results["errors"]), ("LIBRARY ERRORS", results.get("library_errors"))):
        if errors:
            parts.append(
                f"\n{title}:\n" + "\n".join(f"- {e['section']} {e['case']}: {e['error']}" for e in errors)
            )
    return "\n".join(parts)


# ------------------------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="fewer cases and calls (a few minutes on an H100)")
    p.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help=f"JSON results (default {DEFAULT_OUT.relative_to(ROOT)})",
    )
    p.add_argument("--markdown", type=Path, default=None, help="also write the printed tables here")
    p.add_argument(
        "--only", default=",".join(SECTIONS), help=f"comma-separated kernel sections: {','.join(SECTIONS)}"
    )
    p.add_argument(
        "--iters", type=int, default=None, help="timed calls per measurement (default 50; quick 15)"
    )
    p.add_argument("--warmup", type=int, default=None, help="warm-up calls (default 10; quick 3)")
    p.add_argument(
        "--max-seconds", type=float, default=None, help="time budget per measurement (default 5; quick 2)"
    )
    p.add_argument("--ctx", type=int, default=4096, help="MLA context length in tokens (default 4096)")
    p.add_argument(
        "--experts", type=int, default=8, help="local experts of the grouped GEMMs (default 8: 256 over EP32)"
    )
    p.add_argument(
        "--contiguous-align",
        type=int,
        default=1,
        help="pad each expert segment of the contiguous layout to this many rows with -1 rows "
        "(1: none, as dsinfer's MoE layer feeds it; 128: DeepGEMM's layout)",
    )
    p.add_argument("--no-torch", action="store_true", help="do not time the torch references")
    p.add_argument("--no-check", action="store_true", help="do not compare outputs with the torch references")
    p.add_argument("--no-libraries", action="store_true", help="do not import or time DeepGEMM and FlashMLA")
    p.add_argument(
        "--sweep-mla", action="store_true", help="also time MLA launch parameters around the defaults"
    )
    p.add_argument("--mla-batches", default="64,128", help="MLA batch sizes to run (default 64,128)")
    p.add_argument("--mla-s-q", default="1,2", help="MLA query tokens per sequence to run (default 1,2)")
    p.add_argument("--mla-heads", default="16,128", help="MLA query heads to run (default 16,128)")
    p.add_argument("--list", action="store_true", help="print the planned cases and exit (no GPU needed)")
    p.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu: the smoke run (needs TRITON_INTERPRET=1)",
    )
    p.add_argument("--tiny", action="store_true", help="interpreter-sized shapes (with --device cpu)")
    args = p.parse_args(argv)
    args.only = [s.strip() for s in args.only.split(",") if s.strip()]
    args.mla_batches = {int(b) for b in args.mla_batches.split(",")}
    args.mla_s_q = {int(b) for b in args.mla_s_q.split(",")}
    args.mla_heads = {int(b) for b in args.mla_heads.split(",")}
    unknown = [s for s in args.only if s not in SECTIONS]
    if unknown:
        p.error(f"unknown section {unknown[0]!r}; choose from {','.join(SECTIONS)}")
    if args.iters is None:
        args.iters = 15 if args.quick else 50
    if args.warmup is None:
        args.warmup = 3 if args.quick else 10
    if args.max_seconds is None:
        args.max_seconds = 2.0 if args.quick else 5.0
    for name in ("iters", "ctx", "experts", "contiguous_align"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def metadata(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    if args.device == "cpu":
        return {
            "device": "cpu (TRITON_INTERPRET=1: plumbing only, no figure means anything)",
            "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": shlex.join([sys.executable, *argv]),
            "triton": importlib.metadata.version("triton"),
        }
    props = torch.cuda.get_device_properties(0)
    try:
        triton_version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton_version = None
    try:
        from dsinfer.ops.backend import select_ops

        backends = dict(select_ops(DEVICE).backends)
    except Exception as exc:
        backends = {"error": repr(exc)}
    return {
        "device": torch.cuda.get_device_name(0),
        "capability": ".".join(map(str, torch.cuda.get_device_capability(0))),
        "sms": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "python": platform.python_version(),
        "host": platform.node(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *argv]),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "git": git_state(("kernels", "dsinfer/ops")),
        "ops_backends_selected": backends,
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "timing": "GPU time between torch.cuda.Event records around one call; median of N after warm-up; "
        f"{FLUSH_BYTES >> 20} MiB zeroed before each timed call (kernel sections)",
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if not args.list and args.device == "cuda" and not torch.cuda.is_available():
        print("bench_kernels.py: needs a CUDA GPU (torch.cuda.is_available() is False); nothing measured")
        return 0
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("bench_kernels.py: --device cpu needs TRITON_INTERPRET=1 (set before triton is imported)")
        return 2
    kernels = import_kernels()
    v3, v32 = load_v3(), load_v32_sparse()
    plan = make_plan(args, v3, v32)
    if args.list:
        print_plan(plan, v3)
        return 0

    torch.manual_seed(0)
    results: dict[str, Any] = {
        "meta": metadata(args, [str(Path(__file__).relative_to(ROOT)), *argv]),
        "ceilings": {},
        "mla": [],
        "dense_gemm": [],
        "grouped_gemm": [],
        "gate": [],
        "sparse": [],
        "errors": [],
        "library_errors": [],
    }
    log(f"{results['meta']['device']}: torch {torch.__version__}, triton {results['meta']['triton']}")
    timer = Timer(args.warmup, args.iters, args.max_seconds, args.device)
    errors = results["errors"]

    log("ceilings")
    results["ceilings"] = ceil = measure_ceilings(plan, timer)
    write_json(args.out, results)
    fp8_ok = has_fp8(timer.device)
    if not fp8_ok and (plan.gemm or plan.grouped):
        msg = f"compute capability {results['meta']['capability']} < 8.9: no fp8 e4m3, GEMM sections skipped"
        log(msg)
        errors.append({"section": "gemm", "case": "all", "error": msg})

    log("libraries")
    libs, results["meta"]["libraries"] = import_libraries(timer.device, args.no_libraries)

    from dsinfer.ops.external import triton_gemm_adapter

    # The Ops GEMM entry points over dsinfer.kernels: what select_ops builds for the 'triton' backend.
    measure = Run(kernels, triton_gemm_adapter(kernels), libs, ceil, timer, args)
    sections: list[tuple[str, str, list[Any], Callable[[Any], dict[str, Any]]]] = [
        ("mla", "mla", plan.mla, lambda c: bench_mla(c, v3, measure)),
        # before the GEMMs, whose DeepGEMM JIT compilations may use up a caller's time limit
        ("sparse", "sparse", plan.sparse, lambda c: bench_sparse(c, v32, measure)),
        (
            "gemm",
            "dense_gemm",
            plan.gemm if fp8_ok else [],
            lambda c: bench_gemm(c, measure),
        ),
        (
            "grouped",
            "grouped_gemm",
            plan.grouped if fp8_ok else [],
            lambda c: bench_grouped(c, measure),
        ),
        ("gate", "gate", plan.gate, lambda c: bench_gate(c, v3, measure)),
    ]
    for kind, key, cases, run in sections:
        if cases:
            log(kind)
        for case in cases:
            name = case.name if not isinstance(case, GemmCase) else f"{case.name} m{case.m}"
            log(f"  {name}")
            record = guarded(kind, name, errors, lambda case=case, run=run: run(case))
            results[key].append(record)
            errors.extend(entry_errors(kind, record, TRITON_ENTRIES))
            results["library_errors"].extend(entry_errors(kind, record, LIBRARY_ENTRIES))
            write_json(args.out, results)  # after every case: a run cut short keeps what it measured

    if timer.cuda:  # the launched builds' registers and spills, with the JIT's own specialization
        results["jit_usage"] = jit_usage()
    text = report(results)
    print(text)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(text + "\n")
    write_json(args.out, results)
    plot_result(args.out)
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
