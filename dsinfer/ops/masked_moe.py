"""The routed experts over DeepGEMM's masked layout on FP8 GEMMs, quantizing the valid rows only.

Expert ``s`` holds ``masked_m[s]`` valid rows of a ``[S, capacity, H]`` buffer (DeepEP's
low-latency layout). The first GEMM's input is quantized 1x128, its ``[gate | up]`` output goes
through SwiGLU fused with the quantization of the second GEMM's input, and both GEMMs read the
counts on the device: on CUDA the two activation steps are dsinfer.kernels' masked kernels
(kernels/moe_masked.py), which skip the padding rows; elsewhere the torch reference quantizes every
row (the padding rows' values are computed but never read). The capacity is padded to the GEMM's
row alignment only when the caller did not allocate it so (``Ops.masked_m_alignment``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from dsinfer.ops.fp8 import quantize_activation_1x128

Quantized = tuple[torch.Tensor, torch.Tensor]
Operand = tuple[torch.Tensor, torch.Tensor | None]


@dataclass(frozen=True)
class MaskedQuantizers:
    quantize: Callable[[torch.Tensor, torch.Tensor], Quantized]  # (a, masked_m) -> (q, s)
    swiglu: Callable[[torch.Tensor, torch.Tensor], Quantized]  # (gate_up, masked_m) -> (q, s)


@dataclass(frozen=True)
class MaskedGemm:
    """A masked grouped FP8 GEMM of DeepGEMM's signature, its scale layout and row alignment."""

    run: Callable[..., Any]  # ((q, s), (b, b_scale), out, masked_m, expected_m)
    align_scales: Callable[[torch.Tensor], torch.Tensor] | None
    m_alignment: int


def _torch_swiglu_quantize(gate_up: torch.Tensor, masked_m: torch.Tensor) -> Quantized:
    del masked_m
    gate, up = gate_up.float().chunk(2, dim=-1)
    return quantize_activation_1x128(F.silu(gate) * up)


TORCH_QUANTIZERS = MaskedQuantizers(lambda a, masked_m: quantize_activation_1x128(a), _torch_swiglu_quantize)


def kernel_quantizers() -> MaskedQuantizers:
    """dsinfer.kernels' masked kernels when it has them, else the torch reference."""
    try:
        module = importlib.import_module("dsinfer.kernels")
        return MaskedQuantizers(module.quantize_masked_1x128, module.swiglu_quantize_masked)
    except Exception:  # no triton, a broken install, or an older kernels package
        return TORCH_QUANTIZERS


def fp8_masked_experts(
    gemm: MaskedGemm,
    quantizers: MaskedQuantizers,
    packed: torch.Tensor,
    w13: Operand,
    w2: Operand,
    masked_m: torch.Tensor,
    expected_m: int,
) -> torch.Tensor:
    """``MaskedExperts`` (dsinfer/ops/signatures.py) with FP8 weights: [S, capacity, H] -> same."""
    groups, m, hidden = packed.shape
    m_pad = -(-m // gemm.m_alignment) * gemm.m_alignment
    if m_pad != m:  # whole tiles per group stay inside the group's own rows
        padded = packed.new_zeros((groups, m_pad, hidden))
        padded[:, :m] = packed
        packed = padded
    counts = masked_m.to(torch.int32).contiguous()
    expected = max(int(expected_m), 1)

    def scaled(quantized: Quantized) -> Quantized:
        q, s = quantized
        return q, (gemm.align_scales(s) if gemm.align_scales is not None else s)

    gate_up = torch.empty(groups, m_pad, w13[0].shape[1], dtype=torch.bfloat16, device=packed.device)
    gemm.run(scaled(quantizers.quantize(packed, counts)), w13, gate_up, counts, expected)
    out = torch.empty(groups, m_pad, w2[0].shape[1], dtype=torch.bfloat16, device=packed.device)
    gemm.run(scaled(quantizers.swiglu(gate_up, counts)), w2, out, counts, expected)
    return out[:, :m].to(packed.dtype)
