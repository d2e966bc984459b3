"""bf16 read in place by the numba CPU kernels: ``as_float(value)`` inside a kernel is the float32
of a bf16 value held as its uint16 bits (exactly: the bits shifted up), and ``value`` itself for
a float32. A kernel written once over ``as_float`` compiles for either array type, so a bf16
weight or cache is widened in registers as it is loaded, with no float32 copy of it in memory."""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba.extending import intrinsic, overload

__all__ = ["as_float", "float32_from_bits", "rounded_bf16"]


@intrinsic
def float32_from_bits(typingctx: Any, bits: Any) -> Any:
    """uint32 -> the float32 with the same bits."""
    sig = numba.float32(numba.uint32)

    def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


def as_float(value: Any) -> Any:
    """The same outside a kernel, on a numpy uint16 or float32 scalar (kernels use the overload)."""
    if isinstance(value, np.uint16):
        return np.array(np.uint32(value) << np.uint32(16), dtype=np.uint32).view(np.float32)[()]
    return value


@overload(as_float, inline="always")
def _as_float(value: Any) -> Any:
    # the implementations' signatures match the stub's, annotations included (numba checks)
    if value == numba.uint16:

        def widened(value: Any) -> Any:
            return float32_from_bits(np.uint32(value) << np.uint32(16))

        return widened

    def itself(value: Any) -> Any:
        return value

    return itself


@numba.njit(cache=True)
def rounded_bf16(bits):
    """float32 bits (uint32) -> bf16 bits (uint16), rounded to nearest, ties to even, as torch's
    ``.to(torch.bfloat16)`` for finite values (no NaN test: it would cost RMSNorm 15%)."""
    return np.uint16((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
