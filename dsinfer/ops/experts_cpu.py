"""Fused routed experts for CPUs (numba): SwiGLU expert MLPs over rows grouped by expert.

The grouped-GEMM form (:func:`dsinfer.ops.experts.grouped_experts`) sorts the rows, pads them per
expert, runs two batched GEMMs around the SwiGLU and scatters back: at decode sizes most of its
time goes to those dozens of small ops. This kernel does it in one call: rows are grouped by a
counting sort, experts run in parallel, and each expert multiplies its rows in 4x4 register
blocks (every loaded activation or weight feeds four FMAs), with the SwiGLU in between.

Math is fp32: a bf16 activation is widened exactly; bf16 weights are read as their bits and
widened in registers as they are loaded (``dsinfer.ops.bf16_cpu``), never copied. Every row is
computed by the same code whatever the other rows are (rows are zero-padded to whole blocks), so a
row's result does not depend on how a batch is grouped: expert-parallel pools give the same tokens
at every size.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from dsinfer.ops import gemm as torch_gemm
from dsinfer.ops.bf16_cpu import as_float
from dsinfer.ops.compile_ahead import c_array
from dsinfer.ops.dot_block_cpu import dot_block
from dsinfer.ops.exp_cpu import exp32
from dsinfer.ops.experts import grouped_experts

__all__ = ["compile_ahead", "fused_experts", "rows_by_slot"]

_FASTMATH = {"reassoc", "contract", "nsz"}
BLOCK = 4  # rows and output columns per register block


@numba.njit(cache=True, fastmath=_FASTMATH)
def _matmul_nt(a, w, out):
    """out = a @ w^T for a [M, K] with M a multiple of BLOCK and w [N, K]; output columns past the
    last whole block are plain dot products (a column's code never depends on M)."""
    rows, k_dim = a.shape
    n = w.shape[0]
    blocked = n - n % BLOCK
    for j in range(0, blocked, BLOCK):
        for i in range(0, rows, BLOCK):
            dot_block(a, w, i, j, k_dim, out)
    for j in range(blocked, n):
        for i in range(rows):
            dot = np.float32(0.0)
            for k in range(k_dim):
                dot += a[i, k] * as_float(w[j, k])
            out[i, j] = dot


@numba.njit(cache=True)
def rows_by_slot(slots, num_slots):
    """A counting sort of rows by slot: slot s's rows are ``order[starts[s]:starts[s + 1]]``,
    in their original order."""
    m = slots.shape[0]
    starts = np.zeros(num_slots + 1, dtype=np.int64)
    for r in range(m):
        starts[slots[r] + 1] += 1
    for s in range(num_slots):
        starts[s + 1] += starts[s]
    order = np.empty(m, dtype=np.int64)
    fill = starts[:-1].copy()
    for r in range(m):
        order[fill[slots[r]]] = r
        fill[slots[r]] += 1
    return starts, order


@numba.njit(parallel=True, cache=True, fastmath=_FASTMATH, nogil=True)
def _experts(rows, pairs_per_row, slots, w13, w13_bits, w2, w2_bits, out):  # numpy arrays, typed by numba
    """Pair ``p`` reads row ``p // pairs_per_row``; ``w13``/``w2`` float32, or empty with
    ``w13_bits``/``w2_bits`` holding bf16 weights as uint16."""
    hidden = rows.shape[1]
    bf16 = w13_bits.shape[0] > 0
    num_slots = w13_bits.shape[0] if bf16 else w13.shape[0]
    two_inter = w13_bits.shape[1] if bf16 else w13.shape[1]
    inter = two_inter // 2
    starts, order = rows_by_slot(slots, num_slots)
    for s in numba.prange(num_slots):
        count = starts[s + 1] - starts[s]
        if count == 0:
            continue
        padded = -(-count // BLOCK) * BLOCK
        a = np.zeros((padded, hidden), dtype=np.float32)
        for i in range(count):
            a[i] = rows[order[starts[s] + i] // pairs_per_row]
        gate_up = np.empty((padded, two_inter), dtype=np.float32)
        if bf16:
            _matmul_nt(a, w13_bits[s], gate_up)
        else:
            _matmul_nt(a, w13[s], gate_up)
        h = np.empty((padded, inter), dtype=np.float32)
        for i in range(padded):
            for c in range(inter):
                g = gate_up[i, c]
                h[i, c] = g / (np.float32(1.0) + exp32(-g)) * gate_up[i, inter + c]
        y = np.empty((padded, hidden), dtype=np.float32)
        if bf16:
            _matmul_nt(h, w2_bits[s], y)
        else:
            _matmul_nt(h, w2[s], y)
        for i in range(count):
            out[order[starts[s] + i]] = y[i]


# the one signature :func:`fused_experts` calls the kernel with, float32 or bf16 weights
_EXPERTS_SIGNATURE = (
    c_array(numba.float32, 2),  # rows
    numba.int64,  # pairs per row
    c_array(numba.int64, 1),  # slots
    c_array(numba.float32, 3),  # w13 (empty for bf16)
    c_array(numba.uint16, 3),  # w13 bf16 bits (empty for float32)
    c_array(numba.float32, 3),  # w2
    c_array(numba.uint16, 3),  # w2 bits
    c_array(numba.float32, 2),  # out
)


def compile_ahead() -> None:
    """Compile (or load from numba's cache) the kernel for the signature every call uses."""
    _experts.compile(_EXPERTS_SIGNATURE)


def fused_experts(
    rows: torch.Tensor,
    slots: torch.Tensor,
    w13: torch.Tensor,
    w13_scale_inv: torch.Tensor | None,
    w2: torch.Tensor,
    w2_scale_inv: torch.Tensor | None,
    pairs_per_row: int = 1,
) -> torch.Tensor:
    """Each (row, expert) pair through the SwiGLU expert of its local slot, pair ``p`` reading row
    ``p // pairs_per_row``: ``[M, H] -> [M * pairs_per_row, H]`` in ``rows``' dtype and pair order.
    ``w13`` ``[S, 2I, H]`` (gate rows, then up rows), ``w2`` ``[S, H, I]``, CPU tensors; a pair's
    result does not depend on the other pairs. Float32 or bfloat16 weights run fused (a token's
    row read in place for each of its experts); others (block-FP8) through the grouped-GEMM
    reference. The ``FusedExperts`` contract (dsinfer/ops/signatures.py; its reference:
    dsinfer.ops.experts.fused_experts)."""
    fused_dtypes = (torch.float32, torch.bfloat16)
    if w13.dtype not in fused_dtypes or w2.dtype != w13.dtype:
        return grouped_experts(
            torch_gemm.grouped_gemm_contiguous,
            rows,
            slots,
            w13,
            w13_scale_inv,
            w2,
            w2_scale_inv,
            pairs_per_row,
        )
    hidden = w13.shape[2]
    out = torch.empty(rows.shape[0] * pairs_per_row, hidden, dtype=torch.float32)
    if rows.shape[0] == 0:
        return out.to(rows.dtype)
    empty_bits = np.empty((0, 1, 1), dtype=np.uint16)
    if w13.dtype == torch.bfloat16:
        weights = (
            np.empty((0, 1, 1), dtype=np.float32),
            w13.contiguous().view(torch.int16).numpy().view(np.uint16),
            np.empty((0, 1, 1), dtype=np.float32),
            w2.contiguous().view(torch.int16).numpy().view(np.uint16),
        )
    else:
        weights = (w13.contiguous().numpy(), empty_bits, w2.contiguous().numpy(), empty_bits)
    numba.set_num_threads(max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)))
    _experts(
        rows.detach().float().contiguous().numpy(),
        pairs_per_row,
        slots.to(torch.int64).contiguous().numpy(),
        weights[0],
        weights[1],
        weights[2],
        weights[3],
        out.numpy(),
    )
    return out.to(rows.dtype)
