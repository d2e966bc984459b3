"""Backend registry and start-up selection of the kernel implementations.

Every kernel family has an ordered list of candidate backends, best first:

==========  ===========================================  ==============================================
kernel      candidates                                   Ops functions
==========  ===========================================  ==============================================
gemm        deepgemm, triton, torch                      linear, pack_linear_weight, grouped_gemm_*
experts     amx, numba, grouped                          fused_experts
mla         flashmla, triton, numba, torch               mla_decode, mla_decode_absorbed
indexer     deepgemm, triton, torch                      indexer_topk
sparse_mla  flashmla, triton, torch                      sparse_mla_decode
gate        triton, numba, torch                         moe_gate
v4_compress triton, torch                                pool_windows
mxfp4       deepgemm, triton, torch                      mxfp4_grouped_gemm
sampling    triton, torch                                sample
norm        numba, torch                                 rms_norm
==========  ===========================================  ==============================================

A candidate is probed lazily and only at selection: ``deepgemm``/``flashmla`` need a CUDA device
of compute capability 9.0 (the adapters pass DeepGEMM's SM90 fp32 scales, SM100 wants UE8M0;
FlashMLA's dense decode kernel is SM90-only) and a successful ``import deep_gemm`` /
``import flash_mla``, except ``deepgemm`` for ``mxfp4``: DeepGEMM's FP8xFP4 grouped GEMM
(``ops/external_fp4.py``) runs on compute capability 10.x (SM100) only. The FlashMLA and MXFP4
adapters send what their kernels do not take (float32 queries or activations, shapes) to the Triton
kernel when it is available, else to the torch reference; ``triton`` needs a CUDA device and
``dsinfer.kernels`` exporting the kernel's functions (feature check by name, see
``TRITON_FEATURES``: the GEMM family uses DeepGEMM's newer names and signatures, the others the
``Ops`` signatures); ``numba`` (the fused CPU MLA decode of ``ops/mla_cpu.py``) needs a CPU device
and an importable numba; ``torch`` always works. ``numba`` for ``experts`` is the fused CPU MoE of
``ops/experts_cpu.py`` (float32/bfloat16 weights: the CPU loader dequantizes FP8 checkpoints);
``amx`` for ``experts`` (a CPU with AMX bf16 tiles, ``ops/amx_cpu.py``) runs bf16 experts on the
tiles and everything else through that kernel (``ops/experts_amx.py``);
``numba`` for ``norm`` and ``gate`` is the CPU RMSNorm of ``ops/norm_cpu.py`` and the CPU MoE gate of
``ops/gate_cpu.py``;
``grouped`` (always available) runs the routed experts as two grouped GEMMs of the chosen ``gemm``
backend around the SwiGLU (``ops/experts.py``). ``mla_decode_absorbed`` is the chosen ``mla_decode``
between the two batched GEMMs of the absorbed path (``ops/mla.py``), except for ``numba``, whose
kernel folds them in (``ops/mla_cpu.py``). The chosen functions live in the returned (frozen)
:class:`Ops`; nothing global is mutated.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType, ModuleType
from typing import Any

import torch

from dsinfer.ops import gate as torch_gate
from dsinfer.ops import gemm as torch_gemm
from dsinfer.ops import indexer as torch_indexer
from dsinfer.ops import mla as torch_mla
from dsinfer.ops import mxfp4 as torch_mxfp4
from dsinfer.ops import norm as torch_norm
from dsinfer.ops import sampling as torch_sampling
from dsinfer.ops import sparse_mla as torch_sparse_mla
from dsinfer.ops import v4_compress as torch_v4_compress
from dsinfer.ops.compile_ahead import compile_shared
from dsinfer.ops.experts import grouped_experts, masked_experts
from dsinfer.ops.signatures import (
    FusedExperts,
    GroupedGemmContiguous,
    GroupedGemmMasked,
    IndexerTopk,
    Linear,
    MaskedExperts,
    MlaDecode,
    MlaDecodeAbsorbed,
    MoeGate,
    Mxfp4GroupedGemm,
    PackLinearWeight,
    PoolWindows,
    RmsNorm,
    Sample,
    SparseMlaDecode,
)

logger = logging.getLogger("dsinfer.ops")

__all__ = [
    "BACKENDS",
    "KERNELS",
    "TRITON_FEATURES",
    "Ops",
    "capability_unsupported",
    "compile_ahead",
    "parse_prefer",
    "select_ops",
]

# the numba kernels' modules by (kernel, backend), slowest to compile first
NUMBA_MODULES = {
    ("mla", "numba"): "dsinfer.ops.mla_cpu",
    ("experts", "amx"): "dsinfer.ops.experts_amx",
    ("experts", "numba"): "dsinfer.ops.experts_cpu",
    ("gate", "numba"): "dsinfer.ops.gate_cpu",
    ("norm", "numba"): "dsinfer.ops.norm_cpu",
}

KERNELS: tuple[str, ...] = (
    "gemm",
    "experts",
    "mla",
    "indexer",
    "sparse_mla",
    "gate",
    "v4_compress",
    "mxfp4",
    "sampling",
    "norm",
)
BACKENDS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "gemm": ("deepgemm", "triton", "torch"),
        "experts": ("amx", "numba", "grouped"),
        "mla": ("flashmla", "triton", "numba", "torch"),
        "indexer": ("deepgemm", "triton", "torch"),
        "sparse_mla": ("flashmla", "triton", "torch"),
        "gate": ("triton", "numba", "torch"),
        "v4_compress": ("triton", "torch"),
        "mxfp4": ("deepgemm", "triton", "torch"),
        "sampling": ("triton", "torch"),
        "norm": ("numba", "torch"),
    }
)
FP8_CAPABILITY = (8, 9)  # Ada/Hopper: the first GPUs with fp8 e4m3 tensor-core instructions
# DeepGEMM with fp32 block scales (SM100 takes packed UE8M0 instead) and FlashMLA's dense decode
EXTERNAL_CAPABILITY = {"deepgemm": (9, 0), "flashmla": (9, 0)}
# DeepGEMM's FP8xFP4 grouped GEMM (packed e2m1 weights): SM100 kernels only, SM90 asserts
MXFP4_DEEPGEMM_MAJOR = 10
# Names dsinfer.kernels must export for its Triton backend of each kernel to be chosen.
TRITON_FEATURES: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "gemm": ("fp8_gemm_nt", "m_grouped_fp8_gemm_nt_contiguous", "m_grouped_fp8_gemm_nt_masked"),
        "experts": (),
        "mla": ("mla_decode",),
        "indexer": ("indexer_logits",),
        "sparse_mla": ("sparse_mla_decode",),
        "gate": ("moe_gate",),
        "v4_compress": ("pool_windows",),
        "mxfp4": ("mxfp4_grouped_gemm",),
        "sampling": ("sample",),
        "norm": (),
    }
)

Impl = dict[str, Any]  # entry point -> its implementation (and masked_m_alignment, an int)


@dataclass(frozen=True)
class Ops:
    """The kernel entry points chosen for one device; the model calls only these."""

    linear: Linear  # signatures and contracts: dsinfer/ops/signatures.py
    pack_linear_weight: PackLinearWeight  # a weight in the form ``linear`` runs fastest, or None
    grouped_gemm_contiguous: GroupedGemmContiguous
    grouped_gemm_masked: GroupedGemmMasked
    masked_experts: MaskedExperts
    # rows per slot of a masked layout the GEMMs take without padding (DeepGEMM's tile; 1: any):
    # callers round their buffers' capacity to it when they allocate them
    masked_m_alignment: int
    fused_experts: FusedExperts
    mla_decode: MlaDecode
    mla_decode_absorbed: MlaDecodeAbsorbed  # the absorbed path around mla_decode (fused on CPU)
    indexer_topk: IndexerTopk  # V3.2's lightning indexer: logits, then top-k positions
    sparse_mla_decode: SparseMlaDecode
    moe_gate: MoeGate
    pool_windows: PoolWindows  # DeepSeek-V4's compressor pooling
    mxfp4_grouped_gemm: Mxfp4GroupedGemm  # DeepSeek-V4's routed experts in MXFP4 (unverified on GPU)
    sample: Sample
    rms_norm: RmsNorm
    # True: keep checkpoint FP8 weights as fp8 + block scales (the GEMMs take them as they are).
    # False (torch reference on CPU): the loader dequantizes FP8 checkpoints at load.
    supports_fp8_gemm: bool
    device: torch.device
    backends: Mapping[str, str] = field(default_factory=dict)  # kernel -> chosen backend name

    def describe(self) -> str:
        chosen = " ".join(f"{k}={self.backends.get(k, '?')}" for k in KERNELS)
        return f"ops backends: {chosen} (device {self.device})"


def _torch_impl(kernel: str) -> Impl:
    if kernel == "gemm":
        return {
            "linear": torch_gemm.linear,
            "pack_linear_weight": torch_gemm.pack_linear_weight,
            "grouped_gemm_contiguous": torch_gemm.grouped_gemm_contiguous,
            "grouped_gemm_masked": torch_gemm.grouped_gemm_masked,
            "masked_experts": masked_experts,
            "masked_m_alignment": 1,
        }
    if kernel == "mla":
        return {"mla_decode": torch_mla.mla_decode}
    if kernel == "indexer":
        return {"indexer_topk": torch_indexer.indexer_topk}
    if kernel == "sparse_mla":
        return {"sparse_mla_decode": torch_sparse_mla.sparse_mla_decode}
    if kernel == "gate":
        return {"moe_gate": torch_gate.moe_gate}
    if kernel == "v4_compress":
        return {"pool_windows": torch_v4_compress.pool_windows}
    if kernel == "mxfp4":
        return {"mxfp4_grouped_gemm": torch_mxfp4.mxfp4_grouped_gemm}
    if kernel == "norm":
        return {"rms_norm": torch_norm.rms_norm}
    return {"sample": torch_sampling.sample}


def _import(name: str) -> ModuleType | str:
    try:
        return importlib.import_module(name)
    except Exception as exc:  # a broken CUDA extension raises more than ImportError
        return f"import {name} failed: {type(exc).__name__}"


def compile_ahead(ops: Ops) -> None:
    """Compile the chosen numba kernels now (from numba's cache when it has them), sharing the
    work with the machine's other processes (dsinfer/ops/compile_ahead.py). Other backends
    compile on first call."""
    kernels = {}
    for (kernel, backend), name in NUMBA_MODULES.items():
        if ops.backends.get(kernel) == backend:
            module = importlib.import_module(name)
            where = hashlib.sha1(str(module.__file__).encode()).hexdigest()[:12]  # one lock per checkout
            kernels[f"{kernel}-{where}"] = module.compile_ahead
    compile_shared(kernels)


def _gemm_impl(adapter: Any) -> Impl:
    return {
        "linear": adapter.linear,
        "pack_linear_weight": torch_gemm.pack_linear_weight,  # CPU-only: None on a GPU
        "grouped_gemm_contiguous": adapter.grouped_gemm_contiguous,
        "grouped_gemm_masked": adapter.grouped_gemm_masked,
        "masked_experts": adapter.masked_experts,
        "masked_m_alignment": adapter.m_alignment,
    }


def capability_unsupported(
    backend: str, capability: tuple[int, int], kernel: str | None = None
) -> str | None:
    """Why ``backend`` (deepgemm or flashmla) cannot run ``kernel`` (None: the SM90 kernels
    every other family uses) on a GPU of ``capability``, or None."""
    have = ".".join(map(str, capability))
    if backend == "deepgemm" and kernel == "mxfp4":
        if capability[0] != MXFP4_DEEPGEMM_MAJOR:
            return (
                f"DeepGEMM's FP8xFP4 GEMM needs compute capability {MXFP4_DEEPGEMM_MAJOR}.x (SM100), "
                f"this GPU is {have} (DeepGEMM has no packed-FP4 kernel for it)"
            )
        return None
    needed = EXTERNAL_CAPABILITY[backend]
    if capability != needed:
        want = ".".join(map(str, needed))
        return f"{backend} adapter needs compute capability {want} (SM90), this GPU is {have}"
    return None


def _probe(kernel: str, backend: str, device: torch.device) -> Impl | str:
    """The implementation of ``kernel`` by ``backend`` on ``device``, or why it is unavailable."""
    if backend == "torch":
        return _torch_impl(kernel)
    if backend == "grouped":
        return {}  # bound to the chosen GEMM backend by select_ops
    if backend == "amx":  # experts only
        if device.type != "cpu":
            return "needs a CPU device"
        module = _import("dsinfer.ops.experts_amx")
        if isinstance(module, str):
            return module
        if not module.amx_bf16_available():
            return "needs a CPU with AMX bf16 tiles (and numba compiling for them)"
        return {"fused_experts": module.fused_experts}
    if backend == "numba":
        if device.type != "cpu":
            return "needs a CPU device"
        if kernel == "experts":
            module = _import("dsinfer.ops.experts_cpu")
            return module if isinstance(module, str) else {"fused_experts": module.fused_experts}
        if kernel == "norm":
            module = _import("dsinfer.ops.norm_cpu")
            return module if isinstance(module, str) else {"rms_norm": module.rms_norm}
        if kernel == "gate":
            module = _import("dsinfer.ops.gate_cpu")
            return module if isinstance(module, str) else {"moe_gate": module.moe_gate}
        module = _import("dsinfer.ops.mla_cpu")
        if isinstance(module, str):
            return module
        return {"mla_decode": module.mla_decode, "mla_decode_absorbed": module.mla_decode_absorbed}
    if device.type != "cuda":
        return "needs CUDA"
    if backend == "triton":
        module = _import("dsinfer.kernels")
        if isinstance(module, str):
            return module
        missing = [name for name in TRITON_FEATURES[kernel] if not hasattr(module, name)]
        if missing:
            return f"dsinfer.kernels lacks {missing[0]}"
        if kernel == "gemm":
            if torch.cuda.get_device_capability(device) < FP8_CAPABILITY:
                return "fp8 tensor cores need compute capability 8.9 or newer"
            from dsinfer.ops.external import triton_gemm_adapter

            return _gemm_impl(triton_gemm_adapter(module))
        if kernel == "indexer":  # the kernel computes the logits; the top-k is torch's
            return {"indexer_topk": torch_indexer.indexer_topk_with(module.indexer_logits)}
        return {name: getattr(module, name) for name in _torch_impl(kernel)}
    why = capability_unsupported(backend, torch.cuda.get_device_capability(device), kernel)
    if why is not None:
        return why
    module = _import({"deepgemm": "deep_gemm", "flashmla": "flash_mla"}[backend])
    if isinstance(module, str):
        return module
    from dsinfer.ops.external import DeepGemmAdapter, FlashMlaAdapter
    from dsinfer.ops.external_fp4 import DeepGemmMxfp4Adapter
    from dsinfer.ops.external_sparse import DeepGemmIndexerAdapter, FlashMlaSparseAdapter

    try:
        if kernel == "mxfp4":
            triton_fp4 = _probe("mxfp4", "triton", device)
            fp4_fallback = (
                triton_fp4["mxfp4_grouped_gemm"]
                if isinstance(triton_fp4, dict)
                else torch_mxfp4.mxfp4_grouped_gemm
            )
            adapter = DeepGemmMxfp4Adapter(module, fallback=fp4_fallback)
            return {"mxfp4_grouped_gemm": adapter.mxfp4_grouped_gemm}
        if kernel == "indexer":
            return {"indexer_topk": DeepGemmIndexerAdapter(module).indexer_topk}
        if kernel == "sparse_mla":
            return {"sparse_mla_decode": FlashMlaSparseAdapter(module, device=device).sparse_mla_decode}
        if backend == "deepgemm":
            return _gemm_impl(DeepGemmAdapter(module))
        triton_mla = _probe("mla", "triton", device)
        fallback = triton_mla["mla_decode"] if isinstance(triton_mla, dict) else torch_mla.mla_decode
        return {"mla_decode": FlashMlaAdapter(module, fallback=fallback).mla_decode}
    except ImportError as exc:
        return str(exc)


def parse_prefer(prefer: str | None) -> tuple[str, ...]:
    """The backend names of ``prefer`` (comma-separated; None, "" or "auto": none); an unknown
    name raises ValueError listing the known ones."""
    if prefer is None or prefer.strip() in ("", "auto"):
        return ()
    names = tuple(p.strip() for p in prefer.split(",") if p.strip())
    known = {b for order in BACKENDS.values() for b in order}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown ops backend {unknown[0]!r}; choose from {sorted(known)} or 'auto'")
    return names


def select_ops(device: torch.device | str, prefer: str | None = None, quiet: bool = False) -> Ops:
    """Choose one backend per kernel for ``device`` and log the choice in one line (``quiet``: not,
    for a model built only to be measured).

    ``prefer``: None/"auto" = best available; "torch" forces the reference everywhere; another
    backend name (or a comma-separated list) is tried first for the kernels it implements, and
    the log says when it was unavailable.
    """
    device = torch.device(device)
    preferred = parse_prefer(prefer)
    force_torch = "torch" in preferred
    impl: Impl = {}
    chosen: dict[str, str] = {}
    skipped: dict[tuple[str, str], list[str]] = {}  # (backend, reason) -> kernels
    for kernel in KERNELS:
        order = BACKENDS[kernel]
        if force_torch:
            order = ("torch",) if "torch" in BACKENDS[kernel] else (BACKENDS[kernel][-1],)
        elif preferred:
            order = tuple(b for b in preferred if b in order) + tuple(b for b in order if b not in preferred)
        for backend in order:
            found = _probe(kernel, backend, device)
            if isinstance(found, str):
                if device.type == "cuda" or backend in preferred:
                    skipped.setdefault((backend, found), []).append(kernel)
                continue
            impl.update(found)
            chosen[kernel] = backend
            break
    if chosen["experts"] == "grouped":
        impl["fused_experts"] = functools.partial(grouped_experts, impl["grouped_gemm_contiguous"])
    if "mla_decode_absorbed" not in impl:
        impl["mla_decode_absorbed"] = torch_mla.mla_decode_absorbed_with(impl["mla_decode"])
    supports_fp8 = chosen["gemm"] != "torch" or device.type == "cuda"
    ops = Ops(
        supports_fp8_gemm=supports_fp8,
        device=device,
        backends=MappingProxyType(chosen),
        **impl,
    )
    line = ops.describe()
    if skipped:
        line += "; " + "; ".join(f"no {b} for {','.join(ks)} ({why})" for (b, why), ks in skipped.items())
    if not quiet:
        logger.info(line)
    return ops
