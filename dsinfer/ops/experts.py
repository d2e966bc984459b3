"""Routed experts as two grouped GEMMs around the SwiGLU (any GEMM backend, FP8 included).

``grouped_experts`` is ``FusedExperts`` (dsinfer/ops/signatures.py) bound to a grouped GEMM of the
contiguous layout: the rows are sorted by slot (DeepGEMM's contiguous layout), go through it twice
and are put back in order. ``fused_experts`` binds it to the torch reference GEMM: the reference of
the ``FusedExperts`` contract. ``masked_experts`` is the ``MaskedExperts`` reference: the same
experts over the masked layout (rows already in their slot's plane, counts on the device).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from dsinfer.ops import gemm as torch_gemm

# ``GroupedGemmContiguous``'s call (dsinfer/ops/signatures.py, which takes its signatures from here)
GemmContiguous = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor], torch.Tensor]


def fused_experts(
    rows: torch.Tensor,
    slots: torch.Tensor,
    w13: torch.Tensor,
    w13_scale_inv: torch.Tensor | None,
    w2: torch.Tensor,
    w2_scale_inv: torch.Tensor | None,
    pairs_per_row: int = 1,
) -> torch.Tensor:
    """Each (row, expert) pair through the SwiGLU expert of its local slot: ``rows [M, H]``, pair
    ``p`` reading row ``p // pairs_per_row`` (a token's row for its k experts, not copied k times)
    and ``slots [M * pairs_per_row]`` -> ``[M * pairs_per_row, H]`` in ``rows``' dtype and pair
    order. ``w13`` ``[S, 2I, H]`` (gate rows, then up rows), ``w2`` ``[S, H, I]``, either plain or
    block-FP8 with their ``*_scale_inv``; a pair's result does not depend on the other pairs.
    The ``FusedExperts`` contract's reference (the fused CPU kernel is dsinfer/ops/experts_cpu.py)."""
    return grouped_experts(
        torch_gemm.grouped_gemm_contiguous, rows, slots, w13, w13_scale_inv, w2, w2_scale_inv, pairs_per_row
    )


def masked_experts(
    packed: torch.Tensor,
    w13: torch.Tensor,
    w13_scale_inv: torch.Tensor | None,
    w2: torch.Tensor,
    w2_scale_inv: torch.Tensor | None,
    masked_m: torch.Tensor,
    expected_m: int,
) -> torch.Tensor:
    """The SwiGLU experts over the masked layout: ``packed [S, capacity, H]`` holds ``masked_m[s]``
    valid rows for local slot ``s`` -> ``[S, capacity, H]`` in ``packed``'s dtype, the valid rows'
    results; rows past ``masked_m[s]`` are undefined (DeepGEMM's masked layout) and never read.
    ``expected_m`` is the GEMMs' hint of the typical count. No host synchronisation."""
    gate_up = torch_gemm.grouped_gemm_masked(packed, w13, w13_scale_inv, masked_m, expected_m)
    gate, up = gate_up.chunk(2, dim=-1)
    return torch_gemm.grouped_gemm_masked(F.silu(gate) * up, w2, w2_scale_inv, masked_m, expected_m)


def grouped_experts(
    grouped_gemm_contiguous: GemmContiguous,
    rows: torch.Tensor,
    slots: torch.Tensor,
    w13: torch.Tensor,
    w13_scale_inv: torch.Tensor | None,
    w2: torch.Tensor,
    w2_scale_inv: torch.Tensor | None,
    pairs_per_row: int = 1,
) -> torch.Tensor:
    if pairs_per_row > 1:
        rows = rows.repeat_interleave(pairs_per_row, dim=0)
    if rows.shape[0] == 0:
        return rows.new_zeros((0, w2.shape[1]))
    order = torch.argsort(slots, stable=True)
    m_indices = slots[order].to(torch.int32)
    gate_up = grouped_gemm_contiguous(rows[order], w13, w13_scale_inv, m_indices)
    gate, up = gate_up.chunk(2, dim=-1)
    y = grouped_gemm_contiguous(F.silu(gate) * up, w2, w2_scale_inv, m_indices)
    out = torch.empty_like(y)
    out[order] = y
    return out
