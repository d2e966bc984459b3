"""Routed experts as two grouped GEMMs around the SwiGLU (any GEMM backend, FP8 included).

``fused_experts(rows, slots, w13, w13_scale_inv, w2, w2_scale_inv) -> [M, H]``: each row through
the expert in its local slot (``w13`` ``[S, 2I, H]``: gate rows then up rows; ``w2``
``[S, H, I]``), in the rows' order and dtype. This form sorts the rows by slot (DeepGEMM's
contiguous layout), runs ``grouped_gemm_contiguous`` twice and puts the rows back.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

GroupedGemm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor], torch.Tensor]


def grouped_experts(
    grouped_gemm_contiguous: GroupedGemm,
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
