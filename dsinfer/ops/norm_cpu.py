"""RMSNorm for CPUs (numba): one call per norm instead of the eight ATen operations of
``F.rms_norm``, whose dispatch dominates at decode sizes (a row of a few thousand values).

float32 rows with float32 weights, or bf16 rows with bf16 weights (as their bits), one row at a
time, with the reference's rounding (:func:`dsinfer.ops.norm.rms_norm`): bf16 values are widened
exactly, the normalised row is rounded to bf16 (to nearest, ties to even) before the weight
multiplies it, and the product is rounded again. Other dtype pairs go to the reference. A row's
sum of squares runs in the same order whatever the other rows are.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from dsinfer.ops import norm as torch_norm
from dsinfer.ops.bf16_cpu import rounded_bf16
from dsinfer.ops.compile_ahead import c_array

__all__ = ["compile_ahead", "rms_norm"]

_FASTMATH = {"reassoc", "contract", "nsz"}


@numba.njit(cache=True, fastmath=_FASTMATH)
def _rms_f32(x, w, eps, out):
    rows, dim = x.shape
    for i in range(rows):
        squares = np.float32(0.0)
        for j in range(dim):
            squares += x[i, j] * x[i, j]
        scale = np.float32(1.0) / np.sqrt(squares / np.float32(dim) + np.float32(eps))
        for j in range(dim):
            out[i, j] = x[i, j] * scale * w[j]


@numba.njit(cache=True, fastmath=_FASTMATH)
def _rms_bf16(x, w, eps, out):
    rows, dim = x.shape
    row = np.empty(dim, dtype=np.float32)
    row_bits = row.view(np.uint32)
    weight = np.empty(dim, dtype=np.float32)
    weight_bits = weight.view(np.uint32)
    for j in range(dim):
        weight_bits[j] = np.uint32(w[j]) << np.uint32(16)
    for i in range(rows):
        squares = np.float32(0.0)
        for j in range(dim):
            row_bits[j] = np.uint32(x[i, j]) << np.uint32(16)
            squares += row[j] * row[j]
        scale = np.float32(1.0) / np.sqrt(squares / np.float32(dim) + np.float32(eps))
        for j in range(dim):
            row[j] = row[j] * scale
            row_bits[j] = np.uint32(rounded_bf16(row_bits[j])) << np.uint32(16)  # .to(bf16)
            row[j] = row[j] * weight[j]
            out[i, j] = rounded_bf16(row_bits[j])


_F32_SIGNATURE = (
    c_array(numba.float32, 2),
    c_array(numba.float32, 1),
    numba.float64,  # eps, a Python float
    c_array(numba.float32, 2),
)
_BF16_SIGNATURE = (
    c_array(numba.uint16, 2),
    c_array(numba.uint16, 1),
    numba.float64,  # eps
    c_array(numba.uint16, 2),
)


def compile_ahead() -> None:
    """Compile (or load from numba's cache) both kernels for the signatures ``rms_norm`` calls."""
    _rms_f32.compile(_F32_SIGNATURE)
    _rms_bf16.compile(_BF16_SIGNATURE)


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy().view(np.uint16)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The ``RmsNorm`` contract (dsinfer/ops/signatures.py; its reference: dsinfer.ops.norm.rms_norm)."""
    dtype = x.dtype
    if weight.dtype != dtype or dtype not in (torch.float32, torch.bfloat16) or not x.is_cpu:
        return torch_norm.rms_norm(x, weight, eps)
    # a decode step's norm is a few microseconds of work: every wrapper operation counts here
    flat = x.dim() == 2 and x.is_contiguous()
    rows = x if flat else x.reshape(-1, x.shape[-1]).contiguous()
    if rows.requires_grad or weight.requires_grad or not weight.is_contiguous():
        rows, weight = rows.detach(), weight.detach().contiguous()
    out = torch.empty_like(rows)
    if rows.shape[0] > 0:
        if dtype == torch.float32:
            _rms_f32(rows.numpy(), weight.numpy(), eps, out.numpy())
        else:
            _rms_bf16(_bits(rows), _bits(weight), eps, _bits(out))
    return out if flat else out.view(x.shape)
