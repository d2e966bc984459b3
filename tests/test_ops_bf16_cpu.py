"""``as_float`` inside a numba kernel widens every bf16 bit pattern exactly as torch does (the bits
of all 65,536, NaNs and infinities included), and leaves a float32 as it is."""

from __future__ import annotations

import numba
import numpy as np
import torch

from dsinfer.ops.bf16_cpu import as_float


@numba.njit
def _widen_all(values, out):  # type: ignore[no-untyped-def]
    for i in range(values.shape[0]):
        out[i] = as_float(values[i])


def test_every_bf16_bit_pattern_widens_as_torch_does() -> None:
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    out = np.empty(bits.shape[0], dtype=np.float32)
    _widen_all(bits, out)
    expected = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).float().numpy()
    assert np.array_equal(out.view(np.uint32), expected.view(np.uint32))
    in_python = np.array([as_float(b) for b in bits[::97]], dtype=np.float32)  # the stub itself
    assert np.array_equal(in_python.view(np.uint32), expected[::97].view(np.uint32))


def test_a_float32_is_itself() -> None:
    values = np.array([0.0, -0.0, 1.5, -3.25e-20, np.inf, 7e30], dtype=np.float32)
    out = np.empty_like(values)
    _widen_all(values, out)
    assert np.array_equal(out.view(np.uint32), values.view(np.uint32))
