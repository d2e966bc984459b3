"""Adapters from the ``Ops`` entry points to DeepGEMM and FlashMLA.

UNVERIFIED on hardware: neither library can be installed on any machine this project is developed
on. The calls follow the sources of the pinned releases (FlashMLA 9241ae3, DeepGEMM 2.6.1 at
54e2261) and of the older generations the adapters still take; what differs between generations is
probed once, when an adapter is built (``select_ops`` builds them once, at backend selection, and
only when the import succeeds on an SM90 device), and recorded on it (``api``,
``passes_use_legacy``). Whatever they cannot express (non-fp8 weights, shapes the kernels do not
take, a page size other than 64) goes to the torch reference, whose semantics they share.
tests/test_ops_external_probe.py runs them over stand-in modules of each generation.
"""

from __future__ import annotations

import importlib
import inspect
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from dsinfer.ops import experts as torch_experts
from dsinfer.ops import gemm as torch_gemm
from dsinfer.ops import mla as torch_mla
from dsinfer.ops.fp8 import FP8_BLOCK, FP8_DTYPE
from dsinfer.ops.fp8 import quantize_activation_1x128 as torch_quantize_1x128
from dsinfer.ops.masked_moe import (
    TORCH_QUANTIZERS,
    MaskedGemm,
    MaskedQuantizers,
    fp8_masked_experts,
    kernel_quantizers,
)

__all__ = [
    "DEEPGEMM_CONTIGUOUS_ALIGNMENT",
    "ContiguousPadding",
    "DeepGemmAdapter",
    "FlashMlaAdapter",
    "declared_parameters",
    "flash_mla_api",
    "padded_rows",
]

# DeepGEMM's contiguous layout: every expert segment is a multiple of this many rows (documented;
# the module's own get_mk_alignment_for_contiguous_layout / get_m_alignment_... wins when exported).
DEEPGEMM_CONTIGUOUS_ALIGNMENT = 128
_ALIGNMENT_FUNCTIONS = ("get_mk_alignment_for_contiguous_layout", "get_m_alignment_for_contiguous_layout")
Quantizer = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
MlaDecode = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def padded_rows(m: int, alignment: int) -> int:
    """``m`` rounded up to a multiple of ``alignment`` (>= 1)."""
    if alignment < 1:
        raise ValueError(f"alignment must be >= 1, got {alignment}")
    return -(-m // alignment) * alignment


@dataclass(frozen=True)
class ContiguousPadding:
    """Rows of a grouped GEMM laid out as DeepGEMM's contiguous layout wants them: the rows of each
    group together, in group order, each group's segment padded to a multiple of the alignment,
    padding rows marked -1."""

    dest: torch.Tensor  # int64 [M]: the padded row of each input row; -1 for rows whose index is < 0
    m_indices: torch.Tensor  # int32 [M_pad]: the group of each padded row, -1 on padding
    num_rows: int  # M_pad

    def pad(self, a: torch.Tensor) -> torch.Tensor:
        """``a [M, k]`` -> ``[M_pad, k]``, zeros on padding rows."""
        out = a.new_zeros((self.num_rows, *a.shape[1:]))
        keep = self.dest >= 0
        out[self.dest[keep]] = a[keep]
        return out

    def unpad(self, out: torch.Tensor) -> torch.Tensor:
        """``out [M_pad, n]`` -> ``[M, n]`` in the input rows' order, zeros for rows with index < 0."""
        keep = (self.dest >= 0)[:, None]
        return torch.where(keep, out[self.dest.clamp(min=0)], 0.0).to(out.dtype)


def contiguous_padding(m_indices: torch.Tensor, alignment: int) -> ContiguousPadding:
    """Where each row of a contiguous grouped GEMM goes once each group's segment is padded to a
    multiple of ``alignment`` rows. ``m_indices`` needs no order; rows keep their order within a
    group; negative indices are dropped. Reads the group counts on the host (eager paths only)."""
    if alignment < 1:
        raise ValueError(f"alignment must be >= 1, got {alignment}")
    idx = m_indices.long()
    device, num = idx.device, idx.shape[0]
    valid = idx >= 0
    groups = int(idx.max()) + 1 if num and bool(valid.any()) else 0
    counts = torch.bincount(idx[valid], minlength=groups)  # [G]
    padded = (counts + alignment - 1) // alignment * alignment
    first_padded = torch.cumsum(padded, 0) - padded  # start of each group's padded segment
    first_row = torch.cumsum(counts, 0) - counts  # start of each group among the sorted rows
    order = torch.argsort(torch.where(valid, idx, groups), stable=True)  # valid rows by group, then the rest
    num_valid = int(valid.sum())
    sorted_group = idx[order[:num_valid]]
    within = torch.arange(num_valid, device=device) - first_row[sorted_group]
    dest = torch.full((num,), -1, dtype=torch.int64, device=device)
    dest[order[:num_valid]] = first_padded[sorted_group] + within
    num_rows = int(padded.sum())
    padded_indices = torch.full((num_rows,), -1, dtype=torch.int32, device=device)
    padded_indices[dest[valid]] = idx[valid].to(torch.int32)
    return ContiguousPadding(dest, padded_indices, num_rows)


def _kernel_quantizer() -> Quantizer:
    """dsinfer.kernels' Triton 1x128 quantization (bit-identical to the torch reference) when it
    imports, else the torch reference. For CUDA tensors only (Triton kernels run on the GPU)."""
    try:
        module = importlib.import_module("dsinfer.kernels")
    except Exception:  # no triton, or a broken install: the reference computes the same values
        return torch_quantize_1x128
    return getattr(module, "quantize_activation_1x128", torch_quantize_1x128)


def declared_parameters(fn: Callable[..., Any]) -> tuple[inspect.Parameter, ...] | None:
    """The parameters of ``fn``'s signature, or None when it has none (a C extension's function)."""
    try:
        return tuple(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None


def has_parameter(fn: Callable[..., Any], name: str) -> bool:
    """Whether ``fn`` declares a parameter ``name`` (False when its signature is unknown)."""
    params = declared_parameters(fn) or ()
    return any(p.name == name and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params)


# Per API generation: (dense, grouped contiguous, grouped masked) name choices, then the scale-layout
# helper. DeepGEMM 2.6.1 binds the fp8_fp4_* kernels and keeps the fp8_* names as aliases of them;
# the builds of 2025-07/08 named the masked GEMM fp8_m_grouped_gemm_nt_masked.
_DEEPGEMM_APIS: tuple[tuple[str, tuple[tuple[str, ...], ...], str], ...] = (
    (
        "fp8_fp4",
        (
            ("fp8_fp4_gemm_nt",),
            ("m_grouped_fp8_fp4_gemm_nt_contiguous",),
            ("m_grouped_fp8_fp4_gemm_nt_masked",),
        ),
        "get_mn_major_tma_aligned_tensor",
    ),
    (
        "new",
        (
            ("fp8_gemm_nt",),
            ("m_grouped_fp8_gemm_nt_contiguous",),
            ("m_grouped_fp8_gemm_nt_masked", "fp8_m_grouped_gemm_nt_masked"),
        ),
        "get_mn_major_tma_aligned_tensor",
    ),
    (
        "old",
        (
            ("gemm_fp8_fp8_bf16_nt",),
            ("m_grouped_gemm_fp8_fp8_bf16_nt_contiguous",),
            ("m_grouped_gemm_fp8_fp8_bf16_nt_masked",),
        ),
        "get_col_major_tma_aligned_tensor",
    ),
)


def _first_exported(module: ModuleType, names: tuple[str, ...]) -> Callable[..., Any] | None:
    return next((getattr(module, n) for n in names if hasattr(module, n)), None)


class DeepGemmAdapter:
    """UNVERIFIED. Block-FP8 GEMMs through DeepGEMM (or any module exposing one of its name sets;
    ``api`` says which: "fp8_fp4" for 2.6.1's, "new" for the 2025-07 renaming, "old" before it).

    Activations are quantized 1x128 here (by dsinfer.kernels' Triton kernel when it imports);
    weights must already be fp8 with 128x128 scales. Output is computed in bf16 (DeepGEMM's output
    type) and cast to the activation's dtype.

    ``m_alignment``: the row multiple of each expert segment in the contiguous layout, and of the
    rows per group of the masked layout. None asks the module
    (``get_mk_alignment_for_contiguous_layout`` / ``get_m_alignment_...``), else DeepGEMM's
    documented 128; dsinfer.kernels' Triton GEMMs mask partial tiles and take any row count (1):
    then the contiguous layout is passed as it is (unsorted rows, -1 rows), with no padding, no
    host sync and no gather (on the H100 the padding path cost about 1 ms around a 0.1-0.26 ms
    kernel, benchmarks/results/gpu_h100_2026-11-26/run4_kernels.md).

    The masked padding matters: DeepGEMM's SM90 masked kernel stores whole BLOCK_M-row tiles per
    group without checking ``m % BLOCK_M``, so with ``[G, m, k]`` operands whose ``m`` is not a
    multiple of the tile (a decode bucket of 1, 2, 24 ... rows) one group's last tile overwrites
    the next group's first rows. The adapter pads ``m`` to the alignment and returns the first
    ``m`` rows.
    """

    def __init__(self, module: ModuleType, *, m_alignment: int | None = None) -> None:
        for api, choices, align in _DEEPGEMM_APIS:
            dense, contiguous, masked = (_first_exported(module, names) for names in choices)
            if dense is not None and contiguous is not None and masked is not None:
                self.api = api
                self._dense, self._contiguous, self._masked = dense, contiguous, masked
                self._align = getattr(module, align, None)
                self.m_alignment = m_alignment or _module_alignment(module)
                self._cuda_quantize: Quantizer | None = None  # resolved at the first CUDA call
                self._cuda_masked: MaskedQuantizers | None = None
                return
        raise ImportError(f"{module.__name__} exports no DeepGEMM API generation")

    def _quantize(self, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if a.is_cuda:
            if self._cuda_quantize is None:
                self._cuda_quantize = _kernel_quantizer()
            q, s = self._cuda_quantize(a)
        else:
            q, s = torch_quantize_1x128(a)
        # The kernels read activation scales MN-major and TMA-aligned (same values, other layout).
        return q, (self._align(s) if self._align is not None else s)

    @staticmethod
    def _native(b: torch.Tensor, b_scale: torch.Tensor | None) -> bool:
        return b.dtype == FP8_DTYPE and b_scale is not None and b.shape[-1] % FP8_BLOCK == 0

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor | None = None
    ) -> torch.Tensor:
        if not self._native(weight, weight_scale_inv) or x.numel() == 0:
            return torch_gemm.linear(x, weight, weight_scale_inv)
        lead, k = x.shape[:-1], x.shape[-1]
        q, s = self._quantize(x.reshape(-1, k))
        out = torch.empty(q.shape[0], weight.shape[0], dtype=torch.bfloat16, device=x.device)
        self._dense((q, s), (weight, weight_scale_inv), out)
        return out.to(x.dtype).reshape(*lead, weight.shape[0])

    def grouped_gemm_contiguous(
        self, a: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor | None, m_indices: torch.Tensor
    ) -> torch.Tensor:
        if not self._native(b, b_scale) or a.shape[0] == 0:
            return torch_gemm.grouped_gemm_contiguous(a, b, b_scale, m_indices)
        if self.m_alignment == 1:  # rows in any order, -1 rows skipped: no layout, no host sync
            q, s = self._quantize(a)
            out = torch.zeros(a.shape[0], b.shape[1], dtype=torch.bfloat16, device=a.device)
            self._contiguous((q, s), (b, b_scale), out, m_indices.to(torch.int32).contiguous())
            return out.to(a.dtype)
        # pad every expert's segment to the kernel's alignment, run, and drop the padding again
        layout = contiguous_padding(m_indices, self.m_alignment)
        if layout.num_rows == 0:
            return a.new_zeros(a.shape[0], b.shape[1])
        q, s = self._quantize(layout.pad(a))
        out = torch.empty(layout.num_rows, b.shape[1], dtype=torch.bfloat16, device=a.device)
        self._contiguous((q, s), (b, b_scale), out, layout.m_indices)
        return layout.unpad(out).to(a.dtype)  # the contract: rows with index -1 are zero

    def grouped_gemm_masked(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        b_scale: torch.Tensor | None,
        masked_m: torch.Tensor,
        expected_m: int,
    ) -> torch.Tensor:
        if not self._native(b, b_scale) or a.numel() == 0:
            return torch_gemm.grouped_gemm_masked(a, b, b_scale, masked_m, expected_m)
        groups, m, k = a.shape
        m_pad = padded_rows(m, self.m_alignment)
        if m_pad != m:  # whole tiles per group stay inside the group's own rows
            padded = a.new_zeros((groups, m_pad, k))
            padded[:, :m] = a
            a = padded
        q, s = self._quantize(a)
        out = torch.empty(groups, m_pad, b.shape[1], dtype=torch.bfloat16, device=a.device)
        counts = masked_m.to(torch.int32).contiguous()
        self._masked((q, s), (b, b_scale), out, counts, max(int(expected_m), 1))
        return out[:, :m].to(a.dtype)

    def masked_experts(
        self,
        packed: torch.Tensor,
        w13: torch.Tensor,
        w13_scale_inv: torch.Tensor | None,
        w2: torch.Tensor,
        w2_scale_inv: torch.Tensor | None,
        masked_m: torch.Tensor,
        expected_m: int,
    ) -> torch.Tensor:
        """Both masked GEMMs on FP8 inputs quantized over the valid rows only
        (dsinfer/ops/masked_moe.py)."""
        if not (self._native(w13, w13_scale_inv) and self._native(w2, w2_scale_inv)) or packed.numel() == 0:
            return torch_experts.masked_experts(
                packed, w13, w13_scale_inv, w2, w2_scale_inv, masked_m, expected_m
            )
        if packed.is_cuda and self._cuda_masked is None:
            self._cuda_masked = kernel_quantizers()
        quantizers = self._cuda_masked if packed.is_cuda else TORCH_QUANTIZERS
        assert quantizers is not None
        return fp8_masked_experts(
            MaskedGemm(self._masked, self._align, self.m_alignment), quantizers,
            packed, (w13, w13_scale_inv), (w2, w2_scale_inv), masked_m, expected_m,
        )  # fmt: skip


def triton_gemm_adapter(module: ModuleType) -> DeepGemmAdapter:
    """The GEMM adapter over dsinfer.kernels, as ``select_ops`` builds it for the 'triton' backend:
    its grouped GEMMs take unpadded, even unsorted expert rows (alignment 1), so the contiguous
    layout needs no padding. Benchmarks and the GPU kit build it here too, so that what they time
    is what the model runs (the first H100 run timed the 128-row padding path instead)."""
    return DeepGemmAdapter(module, m_alignment=1)


def _module_alignment(module: ModuleType) -> int:
    for name in _ALIGNMENT_FUNCTIONS:
        if hasattr(module, name):
            return int(getattr(module, name)())
    return DEEPGEMM_CONTIGUOUS_ALIGNMENT


def flash_mla_api(module: ModuleType) -> str:
    """ "new" when ``module`` is FlashMLA's scheduler-object generation, else "old".

    The newest package does not export ``FlashMLASchedMeta`` at its top level; it lives in the
    ``flash_mla.flash_mla_interface`` submodule that ``import flash_mla`` loads."""
    interface = getattr(module, "flash_mla_interface", None)
    if hasattr(module, "FlashMLASchedMeta") or hasattr(interface, "FlashMLASchedMeta"):
        return "new"
    return "old"


class FlashMlaAdapter:
    """UNVERIFIED. MLA decode through FlashMLA's ``flash_mla_with_kvcache``.

    Original API: ``get_mla_metadata(cache_seqlens, s_q * h_q // h_kv, h_kv)`` returns
    ``(tile_metadata, num_splits)``, computed on the device. Newest API (``FlashMLASchedMeta``):
    ``get_mla_metadata()`` returns ``(sched_meta, None)``, filled by the first call that uses it
    and reusable while the shapes and the ``cache_seqlens`` values stay the same.

    Metadata is built once per step and reused by every layer: the step's ``cache_seqlens`` is one
    tensor object shared by all layers (``ForwardBatch``), so the adapter keeps the metadata of the
    last ``cache_seqlens`` it saw (held by a weak reference: a later step's new tensor never
    matches a dead one) together with the shapes it was made for. Under CUDA-graph capture the
    first layer's metadata computation is captured and recomputed on every replay.

    What FlashMLA does not take (float32 queries, other page sizes, an empty batch) goes to
    ``fallback``: the Triton kernel on a GPU (no host synchronisation, so a decode step stays
    capturable), else the torch reference.

    ``use_legacy=True`` is passed exactly when the installed ``flash_mla_with_kvcache`` declares a
    ``use_legacy`` parameter (probed once, here; ``passes_use_legacy`` records it). No upstream
    commit up to the pinned 9241ae3 declares it, so it is not passed there; builds that declare it
    want it on for this dense decode path. A function without a readable signature (a C
    extension's) counts as not declaring it.
    """

    PAGE_SIZE = 64

    def __init__(self, module: ModuleType, fallback: MlaDecode = torch_mla.mla_decode) -> None:
        if not (hasattr(module, "get_mla_metadata") and hasattr(module, "flash_mla_with_kvcache")):
            raise ImportError(f"{module.__name__} lacks get_mla_metadata / flash_mla_with_kvcache")
        self._fm = module
        self.api = flash_mla_api(module)
        self.passes_use_legacy = has_parameter(module.flash_mla_with_kvcache, "use_legacy")
        self.fallback = fallback
        self._meta_seqlens: weakref.ref[torch.Tensor] | None = None
        self._meta_key: tuple[int, ...] = ()
        self._meta: tuple[Any, Any] = (None, None)
        self.metadata_builds = 0  # how many times metadata was made (once per step when reused)

    def _metadata(
        self,
        cache_seqlens: torch.Tensor,
        lens: torch.Tensor,
        key: tuple[int, ...],
        heads_per_kv: int,
        h_kv: int,
    ) -> tuple[Any, Any]:
        """``cache_seqlens``: the caller's tensor (the step's identity); ``lens``: it as int32."""
        same_step = self._meta_seqlens is not None and self._meta_seqlens() is cache_seqlens
        if same_step and key == self._meta_key:
            return self._meta
        if self.api == "new":
            meta = self._fm.get_mla_metadata()
        else:
            meta = self._fm.get_mla_metadata(lens, heads_per_kv, h_kv)
        self._meta_seqlens, self._meta_key, self._meta = weakref.ref(cache_seqlens), key, meta
        self.metadata_builds += 1
        return meta

    def mla_decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        block_table: torch.Tensor,
        cache_seqlens: torch.Tensor,
        head_dim_v: int,
        softmax_scale: float,
        causal: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        native = (
            q.dtype in (torch.bfloat16, torch.float16)
            and k_cache.dtype == q.dtype
            and k_cache.shape[1] == self.PAGE_SIZE
            and q.shape[0] > 0
        )
        if not native:
            return self.fallback(q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal)
        lens = cache_seqlens.to(torch.int32).contiguous()
        block_table = block_table.to(torch.int32).contiguous()
        bsz, s_q, h_q, _ = q.shape
        h_kv = k_cache.shape[2]
        key = (bsz, s_q, h_q, k_cache.shape[1], h_kv, int(causal))
        # keyed on the caller's tensor: a converted copy would be new at every layer
        metadata, num_splits = self._metadata(cache_seqlens, lens, key, s_q * h_q // h_kv, h_kv)
        extra = {"use_legacy": True} if self.passes_use_legacy else {}
        out, lse = self._fm.flash_mla_with_kvcache(
            q,
            k_cache,
            block_table,
            lens,
            head_dim_v,
            metadata,
            num_splits,
            softmax_scale=softmax_scale,
            causal=causal,
            **extra,
        )
        return out, lse.float()
