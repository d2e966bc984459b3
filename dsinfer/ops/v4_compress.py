"""DeepSeek-V4's compressor pooling: each window's rows mixed by a softmax over them (torch
reference of ``Ops.pool_windows``; kernels/v4_compress.py is the Triton kernel).

For window ``w`` and channel ``d``: ``out[w, d] = sum_r softmax_r(gate[w, :, d])[r] * kv[w, r, d]``.
``gate`` already holds the per-position bias (the compressor's ``ape``), and ``-inf`` where a row
is absent (CSA's first window has no predecessor); every window has at least one row present. The
softmax is taken in float32 and its weights cast to ``kv``'s dtype, as DeepSeek's reference does.
"""

from __future__ import annotations

import torch

__all__ = ["pool_windows"]


def pool_windows(kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``kv``, ``gate [W, R, D]`` -> ``[W, D]`` in ``kv``'s dtype."""
    if kv.shape != gate.shape or kv.dim() != 3:
        raise ValueError(f"kv and gate must both be [W, R, D], got {tuple(kv.shape)}, {tuple(gate.shape)}")
    weights = gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)
    return (kv * weights).sum(dim=1)
