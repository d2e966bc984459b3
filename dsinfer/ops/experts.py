"""Routed experts as two grouped GEMMs around the SwiGLU (any GEMM backend, FP8 included).

``FusedExperts`` (dsinfer/ops/signatures.py) bound to a ``GroupedGemmContiguous``: the rows are
sorted by slot (DeepGEMM's contiguous layout), go through ``grouped_gemm_contiguous`` twice and
are put back in order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from dsinfer.ops.signatures import GroupedGemmContiguous


def grouped_experts(
    grouped_gemm_contiguous: GroupedGemmContiguous,
    rows: torch.Tensor,
    slots: torch.Tensor,
    w13: torch.Tensor,
    w13_scale_inv: torch.Tensor | None,
    w2: torch.Tensor,
    w2_scale_inv: torch.Tensor | None,
) -> torch.Tensor:
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
