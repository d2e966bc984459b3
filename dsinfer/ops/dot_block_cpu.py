"""A 4x4 block of dot products for the CPU kernels (numba): every loaded row element feeds four
FMAs. The routed experts' GEMM (``dsinfer.ops.experts_cpu``) and MLA's scores
(``dsinfer.ops.mla_attend_cpu``) both run on it."""

from __future__ import annotations

import numba
import numpy as np

from dsinfer.ops.bf16_cpu import as_float

__all__ = ["dot_block"]

_FASTMATH = {"reassoc", "contract", "nsz"}  # let LLVM vectorize over k; keep inf semantics


@numba.njit(cache=True, fastmath=_FASTMATH, inline="always")
def dot_block(a, w, i, j, k_dim, out):
    """out[i..i+3, j..j+3] = a[i..i+3, :k_dim] @ w[j..j+3, :k_dim]^T (``w`` float32 or bf16 bits)."""
    c00 = c01 = c02 = c03 = c10 = c11 = c12 = c13 = np.float32(0.0)
    c20 = c21 = c22 = c23 = c30 = c31 = c32 = c33 = np.float32(0.0)
    for k in range(k_dim):
        w0, w1 = as_float(w[j, k]), as_float(w[j + 1, k])
        w2, w3 = as_float(w[j + 2, k]), as_float(w[j + 3, k])
        a0, a1, a2, a3 = a[i, k], a[i + 1, k], a[i + 2, k], a[i + 3, k]
        c00 += a0 * w0
        c01 += a0 * w1
        c02 += a0 * w2
        c03 += a0 * w3
        c10 += a1 * w0
        c11 += a1 * w1
        c12 += a1 * w2
        c13 += a1 * w3
        c20 += a2 * w0
        c21 += a2 * w1
        c22 += a2 * w2
        c23 += a2 * w3
        c30 += a3 * w0
        c31 += a3 * w1
        c32 += a3 * w2
        c33 += a3 * w3
    out[i, j], out[i, j + 1], out[i, j + 2], out[i, j + 3] = c00, c01, c02, c03
    out[i + 1, j], out[i + 1, j + 1], out[i + 1, j + 2], out[i + 1, j + 3] = c10, c11, c12, c13
    out[i + 2, j], out[i + 2, j + 1], out[i + 2, j + 2], out[i + 2, j + 3] = c20, c21, c22, c23
    out[i + 3, j], out[i + 3, j + 1], out[i + 3, j + 2], out[i + 3, j + 3] = c30, c31, c32, c33
