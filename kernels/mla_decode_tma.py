"""MLA decode's Hopper kernel: whole-page KV tiles by TMA, 64-row query blocks on wgmma.

The same split-KV contract as :mod:`.mla_decode`'s pointer kernel (partials and the combine kernel
are shared; see that module for the semantics), for what Hopper's tensor cores want:

- ``BLOCK_M`` 64 query rows with 8 warps: the shape Triton lowers ``tl.dot`` to wgmma for (it
  needs ``M % 64 == 0`` and whole warpgroups); 32-row blocks fall back to mma.sync.
- KV tiles by tensor descriptor (TMA): a ``BLOCK_N``-key tile never crosses a page when
  ``PAGE_SIZE % BLOCK_N == 0``, so it is one box at row ``page * PAGE_SIZE + key % PAGE_SIZE`` of
  the cache seen as ``[slots, D]``. The copy engine writes it to shared memory: no per-element
  pointers in registers (with pointer loads, 64 x 512 blocks spill 400-900 bytes per thread).
- Value channels in TMA boxes of at most 256 (``BOX``; V3's 512 take two). ``DV_PARTS`` (1 or 2)
  programs per row block:
  - 2: each owns one box of output channels (a 64 x 256 fp32 accumulator; the H100's launched
    builds, Triton 3.6: 246-251 registers, no spill at 64-key tiles) and computes the full
    ``Q K^T`` itself, so scores cost twice; the two are neighbours in the grid and read their KV
    tiles through L2.
  - 1: one program owns both boxes (two accumulators, 128 registers per thread of 8 warps) and
    computes the scores once.

Only a tile that reaches past the sequence's length has its cache rows zeroed before ``P V`` (a
slot there may hold anything, NaN included): every other tile goes from shared memory to the
tensor cores as the copy engine wrote it. Keys past the split's end are zero in ``P``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .mla_launch import MlaLaunch
from .online_softmax import online_softmax_finish, online_softmax_step

__all__ = ["MAX_BOX", "launch_tma", "tma_unsupported", "value_box"]

MAX_BOX = 256  # a TMA box is at most 256 elements per dimension


@triton.jit
def _tile(q_a, q_b, q_pe, kv_desc, pe_desc, slot, key0, stop, last_key, box_a, box_b, acc_a, acc_b, m_i, l_i,
          scale_log2, BLOCK_N: tl.constexpr, DV: tl.constexpr, TWO_BOXES: tl.constexpr,
          ACC_B: tl.constexpr, MASK_KV: tl.constexpr, DOT: tl.constexpr):  # fmt: skip
    """One key tile into the running softmax and accumulators. ``MASK_KV``: the tile reaches past
    the sequence, whose slots may hold anything (NaN included): those rows of the cache are zeroed
    before ``P V``; every other tile goes from shared memory to the tensor cores untouched."""
    kv_a = kv_desc.load([slot, box_a]).to(DOT)
    scores = tl.dot(q_a, tl.trans(kv_a))
    if TWO_BOXES:
        kv_b = kv_desc.load([slot, box_b]).to(DOT)
        scores = tl.dot(q_b, tl.trans(kv_b), scores)
    scores = tl.dot(q_pe, tl.trans(pe_desc.load([slot, DV]).to(DOT)), scores)
    pos = key0 + tl.arange(0, BLOCK_N)
    key_ok = pos < stop
    visible = key_ok[None, :] & (pos[None, :] <= last_key[:, None])
    scores = tl.where(visible, scores * scale_log2, float("-inf"))
    p, alpha, m_i, l_i = online_softmax_step(scores, m_i, l_i)
    p = p.to(DOT)
    if MASK_KV:
        kv_a = tl.where(key_ok[:, None], kv_a, 0.0)
    acc_a = tl.dot(p, kv_a, acc_a * alpha[:, None])  # accumulated in place by the tensor cores
    if ACC_B:
        if MASK_KV:
            kv_b = tl.where(key_ok[:, None], kv_b, 0.0)
        acc_b = tl.dot(p, kv_b, acc_b * alpha[:, None])
    return acc_a, acc_b, m_i, l_i


@triton.jit
def _mla_decode_tma_kernel(
    q_ptr,
    kv_desc,
    pe_desc,
    table_ptr,
    lens_ptr,
    out_ptr,
    lse_ptr,
    scale_log2,
    num_splits,
    rows,
    h_q,
    s_q,
    stride_qb,
    stride_qs,
    stride_qh,
    stride_tb,
    DV: tl.constexpr,
    DPE: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BOX: tl.constexpr,
    DV_PARTS: tl.constexpr,
    CAUSAL: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT: tl.constexpr,
):
    """One (row block, channel part, sequence, split); outputs as the pointer kernel's."""
    row_block = tl.program_id(0) // DV_PARTS  # fastest: a sequence's programs share its KV in L2
    part = tl.program_id(0) % DV_PARTS
    b = tl.program_id(1)
    split = tl.program_id(2)
    seqlen = tl.load(lens_ptr + b)
    TWO_BOXES: tl.constexpr = BOX < DV
    ACC_B: tl.constexpr = TWO_BOXES and DV_PARTS == 1  # one program owns both boxes' channels

    offs_m = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < rows
    tok = offs_m // h_q
    head = offs_m % h_q
    last_key = seqlen - s_q + tok if CAUSAL else tl.zeros([BLOCK_M], tl.int32) + seqlen - 1
    q_rows = q_ptr + b.to(tl.int64) * stride_qb + tok * stride_qs + head * stride_qh
    box_a = part * BOX  # this program's (first) box of value channels
    box_b = BOX - box_a  # the other box: another part's channels, or this program's second box
    offs_c = tl.arange(0, BOX)
    q_a = tl.load(q_rows[:, None] + box_a + offs_c[None, :], mask=row_ok[:, None], other=0.0).to(DOT)
    q_b = q_a
    if TWO_BOXES:
        q_b = tl.load(q_rows[:, None] + box_b + offs_c[None, :], mask=row_ok[:, None], other=0.0).to(DOT)
    offs_pe = tl.arange(0, DPE)
    q_pe = tl.load(q_rows[:, None] + DV + offs_pe[None, :], mask=row_ok[:, None], other=0.0).to(DOT)

    split_len = tl.cdiv(tl.cdiv(seqlen, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    stop = tl.minimum(start + split_len, seqlen)
    whole_stop = tl.minimum(stop, seqlen // BLOCK_N * BLOCK_N)  # tiles wholly inside the sequence
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max, log2 units
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc_a = tl.zeros([BLOCK_M, BOX], tl.float32)
    acc_b = tl.zeros([BLOCK_M, BOX if ACC_B else 16], tl.float32)
    table_row = table_ptr + b.to(tl.int64) * stride_tb
    for key0 in tl.range(start, whole_stop, BLOCK_N):
        slot = tl.load(table_row + key0 // PAGE_SIZE) * PAGE_SIZE + key0 % PAGE_SIZE
        acc_a, acc_b, m_i, l_i = _tile(q_a, q_b, q_pe, kv_desc, pe_desc, slot, key0, stop, last_key, box_a,
                                       box_b, acc_a, acc_b, m_i, l_i, scale_log2, BLOCK_N, DV, TWO_BOXES,
                                       ACC_B, False, DOT)  # fmt: skip
    tail = tl.maximum(start, whole_stop)
    if tail < stop:
        slot = tl.load(table_row + tail // PAGE_SIZE) * PAGE_SIZE + tail % PAGE_SIZE
        acc_a, acc_b, m_i, l_i = _tile(q_a, q_b, q_pe, kv_desc, pe_desc, slot, tail, stop, last_key, box_a,
                                       box_b, acc_a, acc_b, m_i, l_i, scale_log2, BLOCK_N, DV, TWO_BOXES,
                                       ACC_B, True, DOT)  # fmt: skip

    out_a, lse, seen = online_softmax_finish(acc_a, m_i, l_i)
    lse_ok = row_ok & (offs_m * 0 + part == 0)  # one part writes the lse
    if SPLIT:
        at = (b * rows + offs_m).to(tl.int64) * num_splits + split
        tl.store(lse_ptr + at, tl.where(seen, lse, float("-inf")), mask=lse_ok)
    else:
        at = (b * rows + offs_m).to(tl.int64)
        lse_at = (b * h_q + head).to(tl.int64) * s_q + tok
        tl.store(lse_ptr + lse_at, tl.where(seen, lse, float("inf")), mask=lse_ok)
    out_rows = out_ptr + at[:, None] * DV + offs_c[None, :]
    tl.store(out_rows + box_a, out_a.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    if ACC_B:
        out_b, _, _ = online_softmax_finish(acc_b, m_i, l_i)
        tl.store(out_rows + box_b, out_b.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def _power_of_two(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


def value_box(head_dim_v: int, dv_parts: int) -> int:
    """Value channels per TMA box: half of them with two parts or more than a box holds, else all."""
    return head_dim_v // 2 if dv_parts == 2 or head_dim_v > MAX_BOX else head_dim_v


def tma_unsupported(
    q: torch.Tensor, k_cache: torch.Tensor, head_dim_v: int, block_n: int, dv_parts: int
) -> str | None:
    """Why the TMA kernel cannot take these inputs, or None (then the pointer kernel runs)."""
    page_size, dim = k_cache.shape[1], k_cache.shape[3]
    if q.dtype != k_cache.dtype or q.dtype not in (torch.bfloat16, torch.float16):
        return f"needs q and the cache in one 16-bit type, got {q.dtype} and {k_cache.dtype}"
    box = value_box(head_dim_v, dv_parts)
    if dv_parts not in (1, 2) or head_dim_v % box or not _power_of_two(box) or box > MAX_BOX:
        return f"head_dim_v {head_dim_v} in {dv_parts} parts is not boxes of a power of two of 16-{MAX_BOX}"
    if not _power_of_two(dim - head_dim_v):
        return f"rope channels {dim - head_dim_v} are not a power of two >= 16"
    if not _power_of_two(block_n) or page_size % block_n:
        return f"a {block_n}-key tile does not divide the {page_size}-slot page"
    elem = k_cache.element_size()
    if k_cache.stride(3) != 1 or k_cache.stride(0) != page_size * k_cache.stride(1):
        return "the cache is not one [slots, D] matrix"
    if (k_cache.stride(1) * elem) % 16 or k_cache.data_ptr() % 16:
        return "cache rows are not 16-byte aligned"
    return None


def launch_tma(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    table: torch.Tensor,
    lens: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    head_dim_v: int,
    scale_log2: float,
    causal: bool,
    num_splits: int,
    launch: MlaLaunch,
    dot: tl.dtype,
) -> None:
    """One launch over ``(row blocks x launch.dv_parts, B, num_splits)``; ``out``/``lse`` as the
    pointer kernel's (partials when ``num_splits > 1``). The caller checked :func:`tma_unsupported`."""
    bsz, s_q, h_q, dim = q.shape
    num_blocks, page_size = k_cache.shape[:2]
    rows = s_q * h_q
    slots = k_cache.as_strided((num_blocks * page_size, dim), (k_cache.stride(1), 1))
    box = value_box(head_dim_v, launch.dv_parts)
    kv_desc = TensorDescriptor(slots, list(slots.shape), list(slots.stride()), [launch.block_n, box])
    pe_desc = TensorDescriptor(
        slots, list(slots.shape), list(slots.stride()), [launch.block_n, dim - head_dim_v]
    )
    grid = (-(-rows // launch.block_m) * launch.dv_parts, bsz, num_splits)
    _mla_decode_tma_kernel[grid](
        q,
        kv_desc,
        pe_desc,
        table,
        lens,
        out,
        lse,
        scale_log2,
        num_splits,
        rows,
        h_q,
        s_q,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        table.stride(0),
        DV=head_dim_v,
        DPE=dim - head_dim_v,
        PAGE_SIZE=page_size,
        BLOCK_M=launch.block_m,
        BLOCK_N=launch.block_n,
        BOX=box,
        DV_PARTS=launch.dv_parts,
        CAUSAL=causal,
        SPLIT=num_splits > 1,
        DOT=dot,
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
    )
