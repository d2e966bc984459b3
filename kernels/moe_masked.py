"""The activations of the masked-layout MoE path in Triton, over the valid rows only.

In the masked layout (DeepEP's low-latency receive buffer) expert ``g`` holds ``masked_m[g]`` valid
rows of a ``[G, capacity, ...]`` buffer; the rest is padding whose content is undefined. Both
kernels read ``masked_m`` on the device (no host sync) and skip whole row blocks past it, so their
cost follows the tokens received, not the capacity:

- ``quantize_masked_1x128``: the expert input to FP8, one scale per row per 128 channels;
- ``swiglu_quantize_masked``: ``silu(gate) * up`` of the first GEMM's ``[gate | up]`` output,
  fused with the same quantization, the second GEMM's input; with ``limit``, gate clamped from
  above and up on both sides first (DeepSeek-V4's SwiGLU).

Rows past ``masked_m[g]`` of the outputs are left as they were (the masked GEMMs never read them).
Values and scales equal ``dsinfer.ops.fp8.quantize_activation_1x128`` of the same rows bit for bit
(``silu`` in fp32 as ``x * sigmoid(x)``: exact in the interpreter, a few ulps on a GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8_gemm import _AMAX_MIN, _BLOCK_K, _FP8_MAX, FP8_DTYPE, SCALE_BLOCK, _round_to_e4m3

__all__ = ["quantize_masked_1x128", "swiglu_quantize_masked"]

BLOCK_M = 16


@triton.jit
def _quantize_rows(x, q_ptrs, s_ptrs, mask, row_ok):
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), _AMAX_MIN)
    scale = tl.math.div_rn(amax, tl.full(amax.shape, _FP8_MAX, tl.float32))
    q = _round_to_e4m3(tl.math.div_rn(x, tl.broadcast_to(scale[:, None], x.shape)))
    tl.store(q_ptrs, q.to(q_ptrs.dtype.element_ty), mask=mask)
    tl.store(s_ptrs, scale, mask=row_ok)


@triton.jit
def _masked_kernel(
    x_ptr, q_ptr, s_ptr, masked_m_ptr,
    K, limit,
    stride_xg, stride_xm, stride_qg, stride_qm, stride_sg, stride_sm,
    SWIGLU: tl.constexpr, CLAMP: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    group, block, kb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    count = tl.load(masked_m_ptr + group)
    if block * BLOCK_M >= count:
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = kb * _BLOCK_K + tl.arange(0, _BLOCK_K)
    row_ok = rows < count
    mask = row_ok[:, None] & (cols[None, :] < K)
    rows64 = rows.to(tl.int64)
    x_rows = x_ptr + group.to(tl.int64) * stride_xg + rows64[:, None] * stride_xm
    x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if SWIGLU:  # x is the gate; the up projection follows it at column K + j
        up = tl.load(x_rows + K + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if CLAMP:
            x = tl.minimum(x, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
        x = tl.math.div_rn(x, 1.0 + tl.exp(-x)) * up
    q_rows = q_ptr + group.to(tl.int64) * stride_qg + rows64[:, None] * stride_qm
    s_rows = s_ptr + group.to(tl.int64) * stride_sg + rows64 * stride_sm
    _quantize_rows(x, q_rows + cols[None, :], s_rows + kb, mask, row_ok)


def _launch(
    x: torch.Tensor, masked_m: torch.Tensor, k: int, swiglu: bool, limit: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    groups, capacity = x.shape[0], x.shape[1]
    kb = triton.cdiv(k, SCALE_BLOCK)
    q = torch.empty(groups, capacity, k, dtype=FP8_DTYPE, device=x.device)
    s = torch.empty(groups, capacity, kb, dtype=torch.float32, device=x.device)
    if groups and capacity and k:
        if x.stride(-1) != 1:
            x = x.contiguous()
        grid = (groups, triton.cdiv(capacity, BLOCK_M), kb)
        _masked_kernel[grid](
            x, q, s, masked_m.to(torch.int32).contiguous(), k, float(limit or 0.0),
            x.stride(0), x.stride(1), q.stride(0), q.stride(1), s.stride(0), s.stride(1),
            SWIGLU=swiglu, CLAMP=limit is not None, BLOCK_M=BLOCK_M, num_warps=4,
        )  # fmt: skip
    return q, s


def quantize_masked_1x128(a: torch.Tensor, masked_m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``a [G, capacity, k]`` -> (fp8 ``[G, capacity, k]``, fp32 scales ``[G, capacity, ceil(k/128)]``),
    rows below ``masked_m[g]`` only."""
    return _launch(a, masked_m, a.shape[-1], swiglu=False, limit=None)


def swiglu_quantize_masked(
    gate_up: torch.Tensor, masked_m: torch.Tensor, limit: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``gate_up [G, capacity, 2I]`` -> the FP8 quantization of ``silu(gate) * up`` ``[G, capacity, I]``
    and its scales, rows below ``masked_m[g]`` only."""
    return _launch(gate_up, masked_m, gate_up.shape[-1] // 2, swiglu=True, limit=limit)
