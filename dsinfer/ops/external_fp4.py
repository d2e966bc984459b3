"""Adapter from ``Ops.mxfp4_grouped_gemm`` (DeepSeek-V4's MXFP4 routed experts) to DeepGEMM's
FP8xFP4 grouped GEMM.

UNVERIFIED on hardware: DeepGEMM cannot be installed on the machines this project is developed on,
and the kernel runs on SM100 only (compute capability 10.x; on SM90 DeepGEMM asserts on packed FP4
operands, so ``select_ops`` never builds this adapter there). The call follows DeepGEMM 2.6.1 at
54e2261 (csrc/apis/gemm.hpp, csrc/apis/layout.hpp, tests/test_fp8_fp4.py):

``m_grouped_fp8_fp4_gemm_nt_contiguous(a, b, d, grouped_layout, recipe_a=(1, 128),
recipe_b=(1, 32))`` with

- ``a = (e4m3 [M_pad, K], fp32 [M_pad, K/128])``: per token per 128 channels, K-major. SM100 packs
  fp32 scales into UE8M0 by keeping their exponent only (a device assert wants a zero mantissa),
  so the scales here are powers of two, rounded up (DeepGEMM's own tests quantise with
  ``use_ue8m0=True`` there): ``fp8.quantize_activation_1x128(..., ue8m0=True)``;
- ``b = (int8 [G, N, K/2], fp32 [G, N, K/32])``: the e2m1 bytes as they are loaded (even element
  in the low nibble, the packing of dsinfer/ops/mxfp4.py) viewed as int8, DeepGEMM's packed-FP4
  dtype, and the e8m0 scales as float32 powers of two (converted inside, which needs the default
  ``disable_ue8m0_cast=False``);
- ``d`` bf16 ``[M_pad, N]``; ``grouped_layout`` int32 ``[M_pad]``: each row's expert, each expert's
  rows together and padded to ``get_mk_alignment_for_contiguous_layout()`` rows, padding rows -1
  (their output is undefined: the rows are scattered back here and rows of expert -1 are zero).
  Building the layout reads the experts' row counts on the host, as DeepGemmAdapter's padded
  contiguous path does: an eager path, not one to capture in a CUDA graph.

What the kernel cannot express goes to ``fallback`` (the Triton kernel where it is available, else
the torch reference, which share the contract): K not a multiple of 128 (the packed-FP4 operand's
TMA tiles), float32 ``a`` (the kernel writes bf16 from FP8 activations, a float32 caller asks for
more), float32 or other weight scales (not known to be powers of two), malformed shapes, no rows.

The weight scales are converted to float32 at every call, and DeepGEMM packs them into UE8M0 at
every call again; packing them once at load (``get_mn_major_tma_aligned_packed_ue8m0_tensor``, int
scales passed with the same recipe) would save both and is left until the adapter has run on a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from dsinfer.ops import mxfp4 as torch_mxfp4
from dsinfer.ops.external import DEEPGEMM_CONTIGUOUS_ALIGNMENT, contiguous_padding
from dsinfer.ops.fp8 import FP8_BLOCK, quantize_activation_1x128
from dsinfer.ops.mxfp4 import MX_BLOCK, scale_to_float
from dsinfer.ops.signatures import Mxfp4GroupedGemm

__all__ = ["FP4_GEMM", "FP4_K_MULTIPLE", "DeepGemmMxfp4Adapter"]

FP4_GEMM = "m_grouped_fp8_fp4_gemm_nt_contiguous"
FP4_K_MULTIPLE = 128
ACTIVATION_RECIPE = (1, FP8_BLOCK)  # one scale per token per 128 channels
WEIGHT_RECIPE = (1, MX_BLOCK)  # one scale per output channel per 32 channels
_NATIVE_A = (torch.bfloat16, torch.float16)
_NATIVE_B = (torch.uint8, torch.int8)
_NATIVE_SCALES = (torch.float8_e8m0fnu, torch.uint8)  # e8m0, or its raw bytes


class DeepGemmMxfp4Adapter:
    """UNVERIFIED. ``Ops.mxfp4_grouped_gemm`` through DeepGEMM's FP8xFP4 contiguous grouped GEMM.

    ``m_alignment``: the rows of each expert's segment, asked of the module once, here
    (``get_mk_alignment_for_contiguous_layout``), else DeepGEMM's documented 128.
    ``require_cuda=False`` lets the tests run a stand-in module on the CPU.
    """

    def __init__(
        self,
        module: ModuleType,
        *,
        fallback: Mxfp4GroupedGemm = torch_mxfp4.mxfp4_grouped_gemm,
        m_alignment: int | None = None,
        require_cuda: bool = True,
    ) -> None:
        if not hasattr(module, FP4_GEMM):
            raise ImportError(f"{module.__name__} lacks {FP4_GEMM} (DeepGEMM's FP8xFP4 grouped GEMM)")
        self._gemm: Callable[..., Any] = getattr(module, FP4_GEMM)
        align = getattr(module, "get_mk_alignment_for_contiguous_layout", None)
        self.m_alignment = m_alignment or (
            int(align()) if align is not None else DEEPGEMM_CONTIGUOUS_ALIGNMENT
        )
        self.fallback = fallback
        self.require_cuda = require_cuda

    def _native(self, a: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor) -> bool:
        return (
            (a.is_cuda or not self.require_cuda)
            and a.dim() == 2
            and b.dim() == 3
            and b_scale.dim() == 3
            and a.dtype in _NATIVE_A
            and b.dtype in _NATIVE_B
            and b_scale.dtype in _NATIVE_SCALES
            and a.shape[0] > 0
            and a.shape[1] % FP4_K_MULTIPLE == 0
            and a.shape[1] == 2 * b.shape[2]
            and tuple(b_scale.shape) == (*b.shape[:2], a.shape[1] // MX_BLOCK)
        )

    def mxfp4_grouped_gemm(
        self, a: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, expert_of_row: torch.Tensor
    ) -> torch.Tensor:
        if not self._native(a, b, b_scale):
            return self.fallback(a, b, b_scale, expert_of_row)
        layout = contiguous_padding(expert_of_row, self.m_alignment)
        if layout.num_rows == 0:  # every row of expert -1
            return a.new_zeros(a.shape[0], b.shape[1])
        q, q_scale = quantize_activation_1x128(layout.pad(a), ue8m0=True)
        weights = (b.contiguous().view(torch.int8), scale_to_float(b_scale).contiguous())
        out = torch.empty(layout.num_rows, b.shape[1], dtype=torch.bfloat16, device=a.device)
        self._gemm(
            (q, q_scale),
            weights,
            out,
            layout.m_indices,
            recipe_a=ACTIVATION_RECIPE,
            recipe_b=WEIGHT_RECIPE,
        )
        return layout.unpad(out).to(a.dtype)
