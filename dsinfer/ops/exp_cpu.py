"""e^x in float32 for numba kernels, written so that loops over it vectorize.

numba compiles ``np.exp`` on a float32 to a scalar libm call per element, which keeps the loop
around it scalar (the softmax of MLA's decode, the experts' SwiGLU: 3-9% of those kernels' time
on an AMD EPYC, benchmarks/README.md). ``exp32`` is 2^n times a degree-7 Taylor polynomial of the remainder
(|r| <= ln(2) / 2), within 2 ulp of e^x from e^-87 to e^88 and clamped to those ends (so it never
returns 0 or inf: callers that need exp(-inf) = 0 exactly keep ``np.exp``).
"""

from __future__ import annotations

import numba
import numpy as np

from dsinfer.ops.bf16_cpu import float32_from_bits

__all__ = ["exp32"]

_FASTMATH = {"reassoc", "contract", "nsz"}
_LOG2E = np.float32(1.4426950408889634)
_LN2_HIGH, _LN2_LOW = np.float32(0.693359375), np.float32(-2.12194440e-4)  # ln 2 = high + low


@numba.njit(cache=True, fastmath=_FASTMATH, inline="always")
def exp32(x):
    """e^x of a float32 (within 2 ulp; e^-87 .. e^88 at the ends)."""
    x = min(max(x, np.float32(-87.0)), np.float32(88.0))
    n = np.floor(x * _LOG2E + np.float32(0.5))
    r = x - n * _LN2_HIGH - n * _LN2_LOW
    p = np.float32(1.0 / 5040.0)
    p = p * r + np.float32(1.0 / 720.0)
    p = p * r + np.float32(1.0 / 120.0)
    p = p * r + np.float32(1.0 / 24.0)
    p = p * r + np.float32(1.0 / 6.0)
    p = p * r + np.float32(0.5)
    p = p * r + np.float32(1.0)
    p = p * r + np.float32(1.0)
    return p * float32_from_bits(np.uint32(np.int32(n) + np.int32(127)) << np.uint32(23))
