"""The vectorizable float32 exp of the numba kernels (dsinfer/ops/exp_cpu.py)."""

from __future__ import annotations

import numba
import numpy as np

from dsinfer.ops.exp_cpu import exp32


@numba.njit
def _exp_all(x: np.ndarray, out: np.ndarray) -> None:
    for i in range(x.size):
        out[i] = exp32(x[i])


def test_exp32_is_within_two_ulp_and_clamped_at_the_ends() -> None:
    x = np.linspace(-100.0, 100.0, 400_001).astype(np.float32)
    out = np.empty_like(x)
    _exp_all(x, out)
    inside = (x > -87.0) & (x < 88.0)
    exact = np.exp(x[inside].astype(np.float64))
    assert (np.abs(out[inside] - exact) / exact).max() < 2 * 2.0**-24
    assert np.isfinite(out).all() and out[0] > 0  # clamped: a SwiGLU or softmax stays finite


def test_exp32_of_a_softmax_row_sums_as_exp_does() -> None:
    scores = np.random.default_rng(0).normal(0, 8, 4096).astype(np.float32)
    shifted = scores - scores.max()
    out = np.empty_like(shifted)
    _exp_all(shifted, out)
    exact = np.exp(shifted.astype(np.float64))
    assert abs(out.sum(dtype=np.float64) / exact.sum() - 1) < 1e-6
