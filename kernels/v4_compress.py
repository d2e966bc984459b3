"""DeepSeek-V4's compressor pooling as one Triton kernel (``dsinfer.ops.v4_compress`` is the
reference): per window and block of channels, the window's rows (CSA: 2 x 4, HCA: 128) are read
once, their gates softmaxed over the rows in float32 and the rows summed under those weights.

Rows past ``R`` and absent rows (``-inf`` gates) weigh nothing. The sum accumulates in float32
(the reference sums in ``kv``'s dtype: bf16 results may differ in the last bit).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["pool_windows"]


@triton.jit
def _pool_windows_kernel(
    kv_ptr,
    gate_ptr,
    out_ptr,
    R,
    D,
    stride_kw,
    stride_kr,
    stride_kd,
    stride_gw,
    stride_gr,
    stride_gd,
    stride_ow,
    stride_od,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    w = tl.program_id(0)
    rows = tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < R) & (cols[None, :] < D)
    gate = tl.load(
        gate_ptr + w * stride_gw + rows[:, None] * stride_gr + cols[None, :] * stride_gd,
        mask=mask,
        other=float("-inf"),
    ).to(tl.float32)
    top = tl.max(gate, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)  # a padding column: every row masked
    e = tl.exp(gate - top[None, :])
    weights = e / tl.maximum(tl.sum(e, axis=0), 1e-30)[None, :]
    kv = tl.load(
        kv_ptr + w * stride_kw + rows[:, None] * stride_kr + cols[None, :] * stride_kd, mask=mask, other=0.0
    )
    weights = weights.to(kv.dtype).to(tl.float32)  # the reference casts the weights to kv's dtype
    out = tl.sum(kv.to(tl.float32) * weights, axis=0)
    tl.store(out_ptr + w * stride_ow + cols * stride_od, out.to(out_ptr.dtype.element_ty), mask=cols < D)


def pool_windows(kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``kv``, ``gate [W, R, D]`` -> ``[W, D]`` in ``kv``'s dtype: ``dsinfer.ops.v4_compress``."""
    if kv.shape != gate.shape or kv.dim() != 3:
        raise ValueError(f"kv and gate must both be [W, R, D], got {tuple(kv.shape)}, {tuple(gate.shape)}")
    windows, rows, dim = kv.shape
    out = torch.empty(windows, dim, dtype=kv.dtype, device=kv.device)
    if windows == 0 or dim == 0:
        return out
    block_r = triton.next_power_of_2(rows)
    block_d = max(16, min(64, triton.next_power_of_2(dim), 8192 // block_r))
    _pool_windows_kernel[(windows, triton.cdiv(dim, block_d))](
        kv, gate, out, rows, dim,
        kv.stride(0), kv.stride(1), kv.stride(2), gate.stride(0), gate.stride(1), gate.stride(2),
        out.stride(0), out.stride(1),
        BLOCK_R=block_r, BLOCK_D=block_d,
    )  # fmt: skip
    return out
