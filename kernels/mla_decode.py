"""MLA decode over the paged latent KV cache in Triton, with FlashMLA's semantics.

Absorbed MLA: every query head attends to one shared latent KV head of ``D`` channels (512 latent +
64 rope for DeepSeek-V3); keys are all ``D`` channels, values are the first ``head_dim_v`` (the
latent part), so each cached tile is loaded once and used for both ``Q K^T`` and ``P V``. The
query rows of one sequence (``s_q`` tokens x ``h_q`` heads, flattened token-major) are tiled by
``block_m`` and share every key tile, which makes the kernel read the cache once per row block
rather than once per head.

Split-KV: the first kernel gives each (sequence, row block, split) program a contiguous range of
the sequence's keys (the sequence's length divided evenly over the splits, in whole ``block_n``
tiles) and writes that range's softmax-normalised partial output and its log-sum-exp; the second
kernel merges the splits of each row weighted by ``exp(lse_split - lse)``. With one split the
first kernel writes the final result directly. The number of splits depends only on shapes (the
block table's width bounds the length), never on ``cache_seqlens``' values: choosing it needs no
device-to-host sync, and steps of the same shapes (a CUDA graph's) launch the same grids.

Semantics are those of :func:`dsinfer.ops.mla.mla_decode`: token ``t`` of sequence ``b`` is slot
``t % page_size`` of page ``block_table[b, t // page_size]``; with ``causal`` query token ``j`` of
``s_q`` sees keys ``0 .. len - s_q + j``; ``lse`` is natural-log, ``[B, h_q, s_q]``, fp32; a row
with no visible key gets ``out = 0`` and ``lse = +inf``. Only slots below ``cache_seqlens`` are
read. Inputs may be bf16, fp16 or fp32; products accumulate in fp32 (fp32 inputs use IEEE fp32
dots, not TF32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .mla_decode_tma import launch_tma, tma_unsupported
from .mla_launch import (
    CPU_SMS,
    MAX_SPLITS,
    PROGRAMS_PER_SM,
    TMA_PROGRAMS_PER_SM,
    MlaLaunch,
    choose_num_splits,
    default_launch,
    pointer_fallback,
    sm_count,
)
from .online_softmax import FLOAT_DTYPES, LOG2E, channel_constants, online_softmax_finish, online_softmax_step

__all__ = [
    "CPU_SMS",
    "MAX_SPLITS",
    "PROGRAMS_PER_SM",
    "TMA_PROGRAMS_PER_SM",
    "MlaLaunch",
    "choose_num_splits",
    "default_launch",
    "mla_decode",
    "mla_decode_split_kv",
    "pointer_fallback",
]


@triton.jit
def _mla_decode_split_kernel(
    q_ptr,
    kv_ptr,
    table_ptr,
    lens_ptr,
    out_ptr,
    lse_ptr,
    scale_log2,
    num_splits,
    rows,
    h_q,
    s_q,
    table_width,
    stride_qb,
    stride_qs,
    stride_qh,
    stride_kp,
    stride_kt,
    stride_tb,
    DV: tl.constexpr,
    DPE: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_PE: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    SPLIT: tl.constexpr,
    COMPUTE: tl.constexpr,
    DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One (sequence, row block, split): online softmax over the split's keys.

    SPLIT: write partials ``out [B, rows, splits, DV]`` (normalised, in out_ptr's dtype: bf16 for
    16-bit inputs, fp32 otherwise) and ``lse [B, rows, splits]`` (fp32, natural log, -inf when the
    split saw no key); otherwise the final ``out [B, rows,
    DV]`` in out_ptr's dtype and ``lse [B, h_q, s_q]`` (+inf for an empty row). Operands are
    rounded to COMPUTE, then converted to DOT for the products (see ``_dot_dtype``).
    """
    row_block = tl.program_id(0)  # fastest: a sequence's row blocks run together and share its KV in L2
    b = tl.program_id(1)
    split = tl.program_id(2)
    seqlen = tl.load(lens_ptr + b)

    offs_m = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < rows
    tok = offs_m // h_q
    head = offs_m % h_q
    last_key = seqlen - s_q + tok if CAUSAL else tl.zeros([BLOCK_M], tl.int32) + seqlen - 1

    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < DV
    q_rows = q_ptr + b.to(tl.int64) * stride_qb + tok * stride_qs + head * stride_qh
    q_nope = tl.load(q_rows[:, None] + offs_dv[None, :], mask=row_ok[:, None] & dv_ok[None, :], other=0.0)
    q_nope = q_nope.to(DOT)
    if DPE > 0:
        offs_pe = tl.arange(0, BLOCK_PE)
        pe_ok = offs_pe < DPE
        q_pe = tl.load(
            q_rows[:, None] + DV + offs_pe[None, :], mask=row_ok[:, None] & pe_ok[None, :], other=0.0
        ).to(DOT)

    split_len = tl.cdiv(tl.cdiv(seqlen, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    stop = tl.minimum(start + split_len, seqlen)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max, log2 units
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    table_row = table_ptr + b.to(tl.int64) * stride_tb
    for key0 in range(start, stop, BLOCK_N):
        pos = key0 + tl.arange(0, BLOCK_N)
        page_idx = pos // PAGE_SIZE
        key_ok = (pos < stop) & (page_idx < table_width)
        page = tl.load(table_row + page_idx, mask=key_ok, other=0).to(tl.int64)
        k_rows = kv_ptr + page * stride_kp + (pos % PAGE_SIZE) * stride_kt
        kv = tl.load(k_rows[:, None] + offs_dv[None, :], mask=key_ok[:, None] & dv_ok[None, :], other=0.0)
        kv = kv.to(COMPUTE).to(DOT)
        scores = tl.dot(q_nope, tl.trans(kv), input_precision=DOT_PRECISION)
        if DPE > 0:
            k_pe = tl.load(
                k_rows[:, None] + DV + offs_pe[None, :], mask=key_ok[:, None] & pe_ok[None, :], other=0.0
            )
            scores += tl.dot(q_pe, tl.trans(k_pe.to(COMPUTE).to(DOT)), input_precision=DOT_PRECISION)
        visible = key_ok[None, :] & (pos[None, :] <= last_key[:, None])
        scores = tl.where(visible, scores * scale_log2, float("-inf"))
        p, alpha, m_i, l_i = online_softmax_step(scores, m_i, l_i)
        acc = acc * alpha[:, None] + tl.dot(p.to(COMPUTE).to(DOT), kv, input_precision=DOT_PRECISION)

    out, lse, seen = online_softmax_finish(acc, m_i, l_i)
    if SPLIT:
        part = (b * rows + offs_m).to(tl.int64) * num_splits + split
        tl.store(
            out_ptr + part[:, None] * DV + offs_dv[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & dv_ok[None, :],
        )
        tl.store(lse_ptr + part, tl.where(seen, lse, float("-inf")), mask=row_ok)
    else:
        final = (b * rows + offs_m).to(tl.int64) * DV
        tl.store(
            out_ptr + final[:, None] + offs_dv[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & dv_ok[None, :],
        )
        lse_at = (b * h_q + head).to(tl.int64) * s_q + tok
        tl.store(lse_ptr + lse_at, tl.where(seen, lse, float("inf")), mask=row_ok)


@triton.jit
def _mla_decode_combine_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    lse_ptr,
    num_splits,
    rows,
    h_q,
    s_q,
    DV: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """One (sequence, query row): merge the splits' partial outputs by their log-sum-exp."""
    b = tl.program_id(0)
    row = tl.program_id(1)
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < DV
    base = (b * rows + row).to(tl.int64) * num_splits

    lse_max = tl.load(part_lse_ptr + base)
    for s in range(1, num_splits):
        lse_max = tl.maximum(lse_max, tl.load(part_lse_ptr + base + s))
    lse_ref = tl.where(lse_max == float("-inf"), 0.0, lse_max)

    total = tl.zeros([BLOCK_DV], tl.float32)  # the same sum in every lane: keeps the loop vector-typed
    acc = tl.zeros([BLOCK_DV], tl.float32)
    for s in range(num_splits):
        weight = tl.exp(tl.load(part_lse_ptr + base + s) - lse_ref)
        part = tl.load(part_out_ptr + (base + s) * DV + offs_dv, mask=dv_ok, other=0.0).to(tl.float32)
        acc += weight * part
        total += weight
    seen = total > 0.0
    out = acc / tl.where(seen, total, 1.0)
    tl.store(
        out_ptr + (b * rows + row).to(tl.int64) * DV + offs_dv, out.to(out_ptr.dtype.element_ty), mask=dv_ok
    )
    lse = tl.max(tl.where(seen, lse_ref + tl.log(tl.where(seen, total, 1.0)), float("inf")), 0)
    tl.store(lse_ptr + (b * h_q + row % h_q).to(tl.int64) * s_q + row // h_q, lse)


# Triton decides when a kernel is decorated: TRITON_INTERPRET=1 at import gives interpreted kernels.
_INTERPRETED = not isinstance(_mla_decode_split_kernel, triton.runtime.jit.JITFunction)


def _compute_dtype(q: torch.Tensor, k_cache: torch.Tensor) -> torch.dtype:
    for t in (q, k_cache):
        if t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"mla_decode takes float32, bfloat16 or float16 tensors, got {t.dtype}")
    if torch.float32 in (q.dtype, k_cache.dtype):
        return torch.float32
    if q.dtype != k_cache.dtype:  # bf16 with fp16: no common 16-bit type, so compute in fp32
        return torch.float32
    return k_cache.dtype


def _tl_dtype(dtype: torch.dtype) -> tl.dtype:
    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]


def _dot_dtype(compute: torch.dtype) -> torch.dtype:
    """The operand type of the kernel's ``tl.dot``: ``compute`` when compiled. Triton 3.9's
    interpreter multiplies the raw bits of bfloat16 ``tl.dot`` operands, so interpreted kernels
    widen 16-bit operands to fp32 first, which is exact (a product of two 16-bit floats is exact
    in fp32, and the dot accumulates in fp32 either way)."""
    return torch.float32 if _INTERPRETED else compute


def mla_decode_split_kv(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    head_dim_v: int,
    softmax_scale: float,
    causal: bool,
    *,
    num_splits: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    kernel: str | None = None,
    dv_parts: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`mla_decode` with its launch parameters exposed; None takes :func:`default_launch`
    (with :func:`pointer_fallback` where the TMA kernel cannot run) and :func:`choose_num_splits`.
    ``block_m`` and ``block_n`` are powers of two, at least 16; ``kernel`` "tma" raises where the
    TMA kernel cannot take the inputs."""
    bsz, s_q, h_q, dim = q.shape
    num_blocks, page_size, h_kv, dim_k = k_cache.shape
    if h_kv != 1:
        raise ValueError(f"mla_decode expects one latent KV head, got k_cache shape {tuple(k_cache.shape)}")
    if dim_k != dim:
        raise ValueError(f"q head dim {dim} != k_cache head dim {dim_k}")
    if not 0 < head_dim_v <= dim:
        raise ValueError(f"head_dim_v must be in (0, {dim}], got {head_dim_v}")
    if kernel not in (None, "tma", "pointer"):
        raise ValueError(f"kernel must be 'tma' or 'pointer', got {kernel!r}")
    compute = _compute_dtype(q, k_cache)
    rows = s_q * h_q
    launch = default_launch(rows, compute)
    if kernel is not None:
        launch = launch._replace(kernel=kernel, dv_parts=launch.dv_parts if kernel == "tma" else 1)
    launch = launch._replace(
        block_m=block_m or launch.block_m,
        block_n=block_n or launch.block_n,
        num_warps=num_warps or launch.num_warps,
        num_stages=num_stages or launch.num_stages,
        dv_parts=dv_parts or launch.dv_parts,
    )
    for name in ("block_m", "block_n"):
        value = getattr(launch, name)
        if value < 16 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {value}")
    device = q.device
    if bsz == 0 or s_q == 0 or h_q == 0 or num_blocks == 0 or block_table.shape[1] == 0:
        out = torch.zeros(bsz, s_q, h_q, head_dim_v, dtype=q.dtype, device=device)
        return out, torch.full((bsz, h_q, s_q), float("inf"), dtype=torch.float32, device=device)
    q = q.to(compute)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k_cache.stride(-1) != 1:
        raise ValueError("k_cache channels must be contiguous")
    if launch.kernel == "tma":
        why = tma_unsupported(q, k_cache, head_dim_v, launch.block_n, launch.dv_parts)
        if why is not None and kernel == "tma":
            raise ValueError(f"the TMA kernel cannot run: {why}")
        if why is not None:
            launch = pointer_fallback(launch)
    out = torch.empty(bsz, s_q, h_q, head_dim_v, dtype=q.dtype, device=device)  # every row is written
    lse = torch.empty(bsz, h_q, s_q, dtype=torch.float32, device=device)

    row_blocks = -(-rows // launch.block_m)
    if num_splits is None:
        num_splits = choose_num_splits(
            bsz,
            row_blocks * launch.dv_parts,
            block_table.shape[1] * page_size,
            sm_count(device),
            launch.block_n,
            TMA_PROGRAMS_PER_SM if launch.kernel == "tma" else PROGRAMS_PER_SM,
        )
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    table = block_table.to(device=device, dtype=torch.int32)
    if table.stride(1) != 1:
        table = table.contiguous()
    lens = cache_seqlens.to(device=device, dtype=torch.int32).contiguous()
    dot = _dot_dtype(compute)
    split = num_splits > 1
    if split:  # partials in the inputs' 16-bit type (half the traffic of fp32), fp32 for fp32
        part_dtype = torch.float32 if compute == torch.float32 else compute
        part_out = torch.empty(bsz, rows, num_splits, head_dim_v, dtype=part_dtype, device=device)
        part_lse = torch.empty(bsz, rows, num_splits, dtype=torch.float32, device=device)
    else:
        part_out, part_lse = out, lse
    block_dv = max(16, triton.next_power_of_2(head_dim_v))
    if launch.kernel == "tma":
        launch_tma(
            q,
            k_cache,
            table,
            lens,
            part_out,
            part_lse,
            head_dim_v=head_dim_v,
            scale_log2=softmax_scale * LOG2E,
            causal=bool(causal),
            num_splits=num_splits,
            launch=launch,
            dot=_tl_dtype(dot),
        )
    else:
        _launch_pointer(q, k_cache, table, lens, part_out, part_lse, head_dim_v, softmax_scale, causal,
                        num_splits, launch, compute, dot)  # fmt: skip
    if split:
        _mla_decode_combine_kernel[(bsz, rows)](
            part_out, part_lse, out, lse, num_splits, rows, h_q, s_q, DV=head_dim_v, BLOCK_DV=block_dv
        )
    return out, lse


def _launch_pointer(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    table: torch.Tensor,
    lens: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    head_dim_v: int,
    softmax_scale: float,
    causal: bool,
    num_splits: int,
    launch: MlaLaunch,
    compute: torch.dtype,
    dot: torch.dtype,
) -> None:
    bsz, s_q, h_q, dim = q.shape
    rows = s_q * h_q
    _mla_decode_split_kernel[(-(-rows // launch.block_m), bsz, num_splits)](
        q,
        k_cache,
        table,
        lens,
        out,
        lse,
        softmax_scale * LOG2E,
        num_splits,
        rows,
        h_q,
        s_q,
        table.shape[1],
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k_cache.stride(0),
        k_cache.stride(1),
        table.stride(0),
        **channel_constants(head_dim_v, dim),
        PAGE_SIZE=k_cache.shape[1],
        BLOCK_M=launch.block_m,
        BLOCK_N=launch.block_n,
        CAUSAL=bool(causal),
        SPLIT=num_splits > 1,
        COMPUTE=_tl_dtype(compute),
        DOT=_tl_dtype(dot),
        DOT_PRECISION="ieee" if dot == torch.float32 else "tf32",
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
    )


def mla_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    head_dim_v: int,
    softmax_scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged MLA decode: ``(out [B, s_q, h_q, head_dim_v] in q's dtype, lse fp32 [B, h_q, s_q])``.

    ``q [B, s_q, h_q, D]``, ``k_cache [num_blocks, page_size, 1, D]``, ``block_table int [B,
    max_pages]``, ``cache_seqlens int [B]``; the Ops signature (see :mod:`dsinfer.ops.mla`).
    """
    return mla_decode_split_kv(q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal)
