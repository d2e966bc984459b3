"""MXFP4 grouped expert GEMM in Triton: DeepSeek-V4's routed experts without dequantising them at
load (dsinfer/ops/mxfp4.py has the format and the torch reference).

Rows are grouped by expert on the host: sorted, each expert's run padded to ``BLOCK_M`` with
empty rows, so that every row tile belongs to one expert (``tile_expert``). A program computes one
``BLOCK_M x BLOCK_N`` tile of its expert: per ``BLOCK_K`` slice of K (a multiple of the 32-value
scale block) it gathers its rows of ``a``, reads the packed e2m1 bytes and e8m0 scales of its
columns, decodes them in registers (``sign * (code < 2 ? code / 2 : (1 + m / 2) * 2 ** (e - 1))``
times ``2 ** (scale - 127)``: exact in bf16) and accumulates one ``tl.dot`` in float32: on tf32
tensor cores for 16-bit activations (a bf16 value and an e2m1 weight are exact in tf32, so the
products are), IEEE float32 for float32 ones.
Unverified on a GPU; its correctness against the reference is tested on CPU under
``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["mxfp4_grouped_gemm"]

BLOCK_K = 64  # two scale blocks per slice


@triton.jit
def _mxfp4_grouped_kernel(
    a_ptr,
    b_ptr,
    s_ptr,
    d_ptr,
    rows_ptr,
    tile_expert_ptr,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bg,
    stride_bn,
    stride_bk,
    stride_sg,
    stride_sn,
    stride_sk,
    stride_dm,
    stride_dn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(tile_expert_ptr + pid_m)
    rows = tl.load(rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = rows >= 0
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(
            a_ptr + rows[:, None] * stride_am + ks[None, :] * stride_ak,
            mask=valid[:, None] & k_ok[None, :],
            other=0.0,
        )
        w_mask = k_ok[:, None] & col_ok[None, :]
        packed = tl.load(
            b_ptr + expert * stride_bg + cols[None, :] * stride_bn + (ks[:, None] // 2) * stride_bk,
            mask=w_mask,
            other=0,
        ).to(tl.int32)
        code = tl.where((ks[:, None] % 2) == 0, packed & 0xF, (packed >> 4) & 0xF)
        magnitude = code & 7
        exponent = magnitude >> 1
        mantissa = (magnitude & 1).to(tl.float32)
        value = tl.where(
            exponent == 0, mantissa * 0.5, (1.0 + mantissa * 0.5) * tl.exp2((exponent - 1).to(tl.float32))
        )
        value = tl.where(code >= 8, -value, value)
        scale = tl.load(
            s_ptr + expert * stride_sg + cols[None, :] * stride_sn + (ks[:, None] // 32) * stride_sk,
            mask=w_mask,
            other=127,
        ).to(tl.float32)
        w = value * tl.exp2(scale - 127.0)
        acc += tl.dot(a.to(tl.float32), w, input_precision=PRECISION)
    tl.store(
        d_ptr + rows[:, None] * stride_dm + cols[None, :] * stride_dn,
        acc.to(d_ptr.dtype.element_ty),
        mask=valid[:, None] & col_ok[None, :],
    )


def _tiles(expert_of_row: torch.Tensor, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index per tile slot, -1 padding; expert per tile) with each expert's rows in runs of
    whole tiles. Rows of expert -1 are left out."""
    order = torch.argsort(expert_of_row, stable=True)
    experts = expert_of_row[order]
    keep = experts >= 0
    order, experts = order[keep], experts[keep]
    ids, counts = torch.unique_consecutive(experts, return_counts=True)
    rows, tile_expert = [], []
    start = 0
    for expert, count in zip(ids.tolist(), counts.tolist(), strict=True):
        tiles = -(-count // block_m)
        run = torch.full((tiles * block_m,), -1, dtype=torch.int64)
        run[:count] = order[start : start + count]
        rows.append(run)
        tile_expert += [expert] * tiles
        start += count
    if not rows:
        return torch.empty(0, dtype=torch.int32), torch.empty(0, dtype=torch.int32)
    return torch.cat(rows).to(torch.int32), torch.tensor(tile_expert, dtype=torch.int32)


def mxfp4_grouped_gemm(
    a: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, expert_of_row: torch.Tensor
) -> torch.Tensor:
    """``Ops.mxfp4_grouped_gemm`` (dsinfer/ops/mxfp4.py): ``a [M, K]`` (bf16 or float32),
    ``b`` uint8 ``[G, N, K/2]``, ``b_scale`` e8m0 or its uint8 bytes ``[G, N, K/32]``."""
    if a.dim() != 2 or b.dim() != 3 or b.shape[2] * 2 != a.shape[1] or b_scale.shape[:2] != b.shape[:2]:
        raise ValueError(
            f"a must be [M, K], b [G, N, K/2] and b_scale [G, N, K/32], got {tuple(a.shape)}, "
            f"{tuple(b.shape)}, {tuple(b_scale.shape)}"
        )
    m, k = a.shape
    n = b.shape[1]
    out = torch.zeros(m, n, dtype=a.dtype, device=a.device)
    block_m = 16 if m <= 256 else 64
    rows, tile_expert = _tiles(expert_of_row.cpu(), block_m)
    if tile_expert.numel() == 0:
        return out
    rows, tile_expert = rows.to(a.device), tile_expert.to(a.device)
    packed, scales = b.view(torch.uint8), b_scale.view(torch.uint8)
    block_n = 64
    grid = (tile_expert.numel(), triton.cdiv(n, block_n))
    _mxfp4_grouped_kernel[grid](
        a,
        packed,
        scales,
        out,
        rows,
        tile_expert,
        n,
        k,
        a.stride(0),
        a.stride(1),
        packed.stride(0),
        packed.stride(1),
        packed.stride(2),
        scales.stride(0),
        scales.stride(1),
        scales.stride(2),
        out.stride(0),
        out.stride(1),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=BLOCK_K,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
    )
    return out
