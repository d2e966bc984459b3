"""Block-FP8 GEMM and 1x128 activation quantization in Triton, with DeepGEMM's semantics.

Scales as in DeepSeek-V3 checkpoints and DeepGEMM (``dsinfer.ops.fp8`` is the torch reference):
activations carry one fp32 scale per token per 128 channels (``[m, ceil(k/128)]``), weights one per
128x128 block (``[ceil(n/128), ceil(k/128)]``). The GEMM walks K in steps of exactly one scale
block: each step is one fp8 x fp8 tensor-core product (exact products, fp32 sums over 128 terms)
that is scaled by ``sa[m] * sb[n]`` and added to an fp32 accumulator, the same promotion DeepGEMM
does. Scales are read through their strides, so row-major and DeepGEMM's MN-major (TMA-aligned)
scale layouts both work. Partial blocks (``k`` or ``n`` not a multiple of 128) are masked.

Tile sizes come from the H100 sweeps (:func:`tile_config`; benchmarks/kernels/sweep_gemm.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["fp8_gemm_nt", "quantize_activation_1x128"]

FP8_DTYPE = torch.float8_e4m3fn
SCALE_BLOCK = 128
_BLOCK_K = tl.constexpr(SCALE_BLOCK)
_FP8_MAX = tl.constexpr(448.0)
_AMAX_MIN = tl.constexpr(1e-4)


@triton.jit
def _round_to_e4m3(v):
    """Round fp32 ``v`` to the nearest float8 e4m3fn value (ties to even), saturating at +-448.

    Done in fp32 arithmetic so that the cast to fp8 afterwards is exact on every backend (the
    Triton interpreter's own fp32 -> fp8 cast does not round correctly).
    """
    bits = v.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127
    # e4m3 keeps 3 mantissa bits; below 2^-6 the spacing stays 2^-9 (subnormals).
    spacing_exp = tl.maximum(exponent - 3, -9)
    # 1.5 * 2^(23 + spacing_exp): adding it rounds |v| to a multiple of the spacing (ties to even).
    magic = (((spacing_exp + 150) << 23) | 0x400000).to(tl.float32, bitcast=True)
    mag = tl.minimum((tl.abs(v) + magic) - magic, _FP8_MAX)
    return tl.where(bits < 0, -mag, mag)


@triton.jit
def _quantize_1x128_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    M,
    K,
    stride_xm,
    stride_xk,
    stride_qm,
    stride_sm,
    stride_sk,
    BLOCK_M: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    kb = tl.program_id(1)
    cols = kb * _BLOCK_K + tl.arange(0, _BLOCK_K)
    row_ok = rows < M
    mask = row_ok[:, None] & (cols[None, :] < K)
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_xm + cols[None, :] * stride_xk, mask=mask, other=0.0)
    x = x.to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), _AMAX_MIN)
    # IEEE divisions (plain `/` is approximate on GPUs): bit-identical to the torch reference.
    scale = tl.math.div_rn(amax, tl.full(amax.shape, _FP8_MAX, tl.float32))
    q = _round_to_e4m3(tl.math.div_rn(x, tl.broadcast_to(scale[:, None], x.shape)))
    tl.store(q_ptr + rows64[:, None] * stride_qm + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + rows64 * stride_sm + kb * stride_sk, scale, mask=row_ok)


def quantize_activation_1x128(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x[..., k]`` per token per 128 channels -> ``(q fp8[..., k], scales fp32[..., ceil(k/128)])``.

    Same values, bit for bit, as ``dsinfer.ops.fp8.quantize_activation_1x128``.
    """
    k = x.shape[-1]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m, kb = x2.shape[0], triton.cdiv(k, SCALE_BLOCK)
    q = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    s = torch.empty(m, kb, dtype=torch.float32, device=x.device)
    if m and k:
        block_m = 16
        _quantize_1x128_kernel[(triton.cdiv(m, block_m), kb)](
            x2, q, s, m, k, x2.stride(0), x2.stride(1), q.stride(0), s.stride(0), s.stride(1),
            BLOCK_M=block_m, num_warps=4,
        )  # fmt: skip
    return q.reshape(*lead, k), s.reshape(*lead, kb)


@triton.jit
def _swizzle(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """Program id -> (tile row, tile column), GROUP_M tile rows at a time (weight tiles stay in L2)."""
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_rows, (pid % per_group) // group_rows


@triton.jit
def _tile_offsets(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """The rows and columns of this program's ``[BLOCK_M, BLOCK_N]`` tile of an ``[M, N]`` output."""
    pid_m, pid_n = _swizzle(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    return pid_m * BLOCK_M + tl.arange(0, BLOCK_M), pid_n * BLOCK_N + tl.arange(0, BLOCK_N)


@triton.jit
def _scaled_dot(
    a_ptr,
    sa_ptr,
    b_ptr,
    sb_ptr,
    offs_m,
    offs_n,
    row_mask,
    N,
    K,
    stride_am,
    stride_ak,
    stride_sam,
    stride_sak,
    stride_bn,
    stride_bk,
    stride_sbn,
    stride_sbk,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """fp32 ``[BLOCK_M, BLOCK_N]`` tile of ``(A*sa) @ (B*sb)^T``; rows outside ``row_mask`` give 0.

    With ``BLOCK_N <= 128`` (every tile :func:`tile_config` picks) a tile's columns lie in one
    128-row block of B, so B's scale is one scalar per K step: the promotion is one multiply-add
    per element with the per-row factor ``sa * sb``, not two multiplies and an add."""
    offs_k = tl.arange(0, _BLOCK_K)
    col_mask = offs_n < N
    rows64 = offs_m.to(tl.int64)
    cols64 = offs_n.to(tl.int64)
    a_ptrs = a_ptr + rows64[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + cols64[None, :] * stride_bn + offs_k[:, None] * stride_bk
    sa_ptrs = sa_ptr + rows64 * stride_sam
    ONE_SB: tl.constexpr = BLOCK_N <= _BLOCK_K
    if ONE_SB:
        sb_ptrs = sb_ptr + (tl.min(offs_n, 0) // _BLOCK_K) * stride_sbn
    else:
        sb_ptrs = sb_ptr + (offs_n // _BLOCK_K) * stride_sbn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, _BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_mask[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=col_mask[None, :], other=0.0)
        else:
            k_ok = offs_k < K - kb * _BLOCK_K
            a = tl.load(a_ptrs, mask=row_mask[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=col_mask[None, :] & k_ok[:, None], other=0.0)
        sa = tl.load(sa_ptrs + kb * stride_sak, mask=row_mask, other=0.0)
        if ONE_SB:
            acc += tl.dot(a, b) * (sa * tl.load(sb_ptrs + kb * stride_sbk))[:, None]
        else:
            sb = tl.load(sb_ptrs + kb * stride_sbk, mask=col_mask, other=0.0)
            acc += tl.dot(a, b) * sa[:, None] * sb[None, :]
        a_ptrs += _BLOCK_K * stride_ak
        b_ptrs += _BLOCK_K * stride_bk
    return acc


@triton.jit
def _masked_tile(masked_m_ptr, M_MAX, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """A masked grouped GEMM program's tile: ``(group, pid_m, pid_n, offs_m, offs_n, row_mask,
    live)``, groups on grid axis 1 (int64: a group's offsets pass 2^31), swizzled tiles over
    ``max_m x n`` on axis 0; ``live`` is False past the group's valid rows (the program exits)."""
    g = tl.program_id(1).to(tl.int64)
    pid_m, pid_n = _swizzle(tl.program_id(0), tl.cdiv(M_MAX, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    valid_rows = tl.minimum(tl.load(masked_m_ptr + g).to(tl.int32), M_MAX)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return g, pid_m, pid_n, offs_m, offs_n, offs_m < valid_rows, pid_m * BLOCK_M < valid_rows


@triton.jit
def _store_tile(d_ptr, acc, offs_m, offs_n, row_mask, N, stride_dm, stride_dn, ACCUMULATE: tl.constexpr):
    ptrs = d_ptr + offs_m.to(tl.int64)[:, None] * stride_dm + offs_n[None, :] * stride_dn
    mask = row_mask[:, None] & (offs_n < N)[None, :]
    if ACCUMULATE:
        acc += tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptrs, acc.to(d_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fp8_gemm_nt_kernel(
    a_ptr,
    sa_ptr,
    b_ptr,
    sb_ptr,
    d_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_sam,
    stride_sak,
    stride_bn,
    stride_bk,
    stride_sbn,
    stride_sbk,
    stride_dm,
    stride_dn,
    ACCUMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    offs_m, offs_n = _tile_offsets(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    row_mask = offs_m < M
    acc = _scaled_dot(
        a_ptr, sa_ptr, b_ptr, sb_ptr, offs_m, offs_n, row_mask, N, K,
        stride_am, stride_ak, stride_sam, stride_sak, stride_bn, stride_bk, stride_sbn, stride_sbk,
        BLOCK_M, BLOCK_N, EVEN_K,
    )  # fmt: skip
    _store_tile(d_ptr, acc, offs_m, offs_n, row_mask, N, stride_dm, stride_dn, ACCUMULATE)


def tile_config(m: int, n: int) -> dict[str, int]:
    """Launch parameters for ``m`` rows (or the expected rows per group) and ``n`` columns.

    From the H100 sweep (benchmarks/kernels/sweep_gemm.py, 2026-11-26): 64x128 with 4 warps is the
    fastest tile at 4096 rows and wide outputs (o_proj 1355 us; 128x128 with 8 warps 1510-1579);
    64x64 is faster at 64-128 rows (8-18%) and for narrow outputs (kv_a_proj, n = 576: 71 against
    87 us at 4096 rows). Fewer rows than 64 are not measured yet.
    """
    block_m = min(max(triton.next_power_of_2(max(m, 1)), 16), 64)
    block_n = min(max(triton.next_power_of_2(max(n, 1)), 16), 128)
    if block_m == 64 and (m <= 128 or n <= 1024):
        block_n = min(block_n, 64)
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}


def check_operands(
    a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor], d: torch.Tensor, name: str
) -> None:
    """The dtype and scale-shape contract shared by the dense and grouped GEMMs (leading dims free)."""
    (qa, sa), (qb, sb) = a, b
    if qa.dtype != FP8_DTYPE or qb.dtype != FP8_DTYPE:
        raise TypeError(f"{name}: A and B must be {FP8_DTYPE}, got {qa.dtype} and {qb.dtype}")
    if sa.dtype != torch.float32 or sb.dtype != torch.float32:
        raise TypeError(f"{name}: scales must be float32, got {sa.dtype} and {sb.dtype}")
    if d.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"{name}: output must be bfloat16 or float32, got {d.dtype}")
    k = qa.shape[-1]
    if qb.shape[-1] != k:
        raise ValueError(f"{name}: A {tuple(qa.shape)} and B {tuple(qb.shape)} disagree on k")
    kb, nb = triton.cdiv(k, SCALE_BLOCK), triton.cdiv(qb.shape[-2], SCALE_BLOCK)
    if tuple(sa.shape) != (*qa.shape[:-1], kb):
        raise ValueError(f"{name}: A scales {tuple(sa.shape)} do not fit A {tuple(qa.shape)} (1x128 blocks)")
    if tuple(sb.shape) != (*qb.shape[:-2], nb, kb):
        raise ValueError(
            f"{name}: B scales {tuple(sb.shape)} do not fit B {tuple(qb.shape)} (128x128 blocks)"
        )


def fp8_gemm_nt(
    a: tuple[torch.Tensor, torch.Tensor],
    b: tuple[torch.Tensor, torch.Tensor],
    d: torch.Tensor,
    c: torch.Tensor | None = None,
    tile: dict[str, int] | None = None,
) -> None:
    """DeepGEMM's ``fp8_gemm_nt``: ``d = (A * sa) @ (B * sb)^T (+ c)`` with fp32 accumulation.

    ``a = (A fp8 [m, k], sa fp32 [m, ceil(k/128)])``, ``b = (B fp8 [n, k], sb fp32 [ceil(n/128),
    ceil(k/128)])``, ``d`` bf16 or fp32 ``[m, n]`` is written in place; ``c`` (optional, shape of
    ``d``) is added, as DeepGEMM's accumulating variant does. ``tile`` replaces
    :func:`tile_config`'s launch parameters (tuning: benchmarks/kernels/sweep_gemm.py).
    """
    check_operands(a, b, d, "fp8_gemm_nt")
    (qa, sa), (qb, sb) = a, b
    m, k = qa.shape
    n = qb.shape[0]
    if tuple(d.shape) != (m, n):
        raise ValueError(f"fp8_gemm_nt: output {tuple(d.shape)} must be [{m}, {n}]")
    if c is not None and tuple(c.shape) != (m, n):
        raise ValueError(f"fp8_gemm_nt: c {tuple(c.shape)} must be [{m}, {n}]")
    if m == 0 or n == 0:
        return
    accumulate = c is not None
    if c is not None and c.data_ptr() != d.data_ptr():
        d.copy_(c)
    if k == 0:
        if not accumulate:
            d.zero_()
        return
    cfg = tile or tile_config(m, n)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    _fp8_gemm_nt_kernel[grid](
        qa, sa, qb, sb, d, m, n, k,
        qa.stride(0), qa.stride(1), sa.stride(0), sa.stride(1),
        qb.stride(0), qb.stride(1), sb.stride(0), sb.stride(1),
        d.stride(0), d.stride(1),
        ACCUMULATE=accumulate, EVEN_K=k % SCALE_BLOCK == 0, **cfg,
    )  # fmt: skip
