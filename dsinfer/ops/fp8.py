"""Block-FP8 quantization with DeepSeek's fine-grained scales, and the reference FP8 GEMM.

Scale conventions (identical to DeepGEMM and DeepSeek-V3 checkpoints):

- activations: one fp32 scale per token per 128 channels ("1x128"), shape ``[m, ceil(k/128)]``;
- weights: one fp32 scale per 128x128 block, shape ``[ceil(n/128), ceil(k/128)]``
  (checkpoints call it ``weight_scale_inv``: the dequantized weight is ``q * s``).

Quantization: ``amax`` of the block clamped to >= 1e-4, ``scale = amax / 448``, ``q = x / scale``
cast to float8 e4m3fn. Partial last blocks (``k`` or ``n`` not a multiple of 128) are supported:
the block simply has fewer elements.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
FP8_BLOCK = 128
AMAX_MIN = 1e-4

__all__ = [
    "AMAX_MIN",
    "FP8_BLOCK",
    "FP8_DTYPE",
    "FP8_MAX",
    "ceil_div",
    "dequantize_activation_1x128",
    "dequantize_weight_128x128",
    "fp8_gemm_nt",
    "quantize_activation_1x128",
    "quantize_weight_128x128",
    "round_up_to_power_of_two",
]


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _pad_last(x: torch.Tensor, multiple: int) -> torch.Tensor:
    pad = (-x.shape[-1]) % multiple
    return torch.nn.functional.pad(x, (0, pad)) if pad else x


def round_up_to_power_of_two(scale: torch.Tensor) -> torch.Tensor:
    """Positive float32 scales rounded up to the next power of two (UE8M0 values), exactly."""
    mantissa, exponent = torch.frexp(scale)  # scale = mantissa * 2**exponent, mantissa in [0.5, 1)
    return torch.ldexp(torch.ones_like(scale), exponent - (mantissa == 0.5).to(exponent.dtype))


def quantize_activation_1x128(x: torch.Tensor, *, ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x[..., k]`` per token per 128 channels.

    Returns ``(q fp8[..., k], scales fp32[..., ceil(k/128)])`` with ``x ~= q * scales`` blockwise.
    ``ue8m0``: each scale rounded up to a power of two (DeepGEMM's SM100 kernels keep only the
    exponent of an fp32 scale), so ``q`` never exceeds 448 in magnitude either way.
    """
    k = x.shape[-1]
    kb = ceil_div(k, FP8_BLOCK)
    xf = _pad_last(x.float(), FP8_BLOCK).unflatten(-1, (kb, FP8_BLOCK))
    amax = xf.abs().amax(dim=-1).clamp_min(AMAX_MIN)
    scale = amax / FP8_MAX
    if ue8m0:
        scale = round_up_to_power_of_two(scale)
    q = (xf / scale.unsqueeze(-1)).flatten(-2)[..., :k].to(FP8_DTYPE)
    return q, scale


def dequantize_activation_1x128(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of :func:`quantize_activation_1x128`: ``x[..., j] = q[..., j] * scale[..., j // 128]``."""
    k = q.shape[-1]
    expanded = scale.float().repeat_interleave(FP8_BLOCK, dim=-1)[..., :k]
    return (q.float() * expanded).to(dtype)


def quantize_weight_128x128(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``w[n, k]`` per 128x128 block -> ``(q fp8[n, k], scale_inv fp32[ceil(n/128), ceil(k/128)])``."""
    if w.dim() != 2:
        raise ValueError(f"quantize_weight_128x128 expects a 2-D weight, got shape {tuple(w.shape)}")
    n, k = w.shape
    nb, kb = ceil_div(n, FP8_BLOCK), ceil_div(k, FP8_BLOCK)
    wf = torch.nn.functional.pad(w.float(), (0, kb * FP8_BLOCK - k, 0, nb * FP8_BLOCK - n))
    blocks = wf.reshape(nb, FP8_BLOCK, kb, FP8_BLOCK)
    amax = blocks.abs().amax(dim=(1, 3)).clamp_min(AMAX_MIN)  # [nb, kb]
    scale = amax / FP8_MAX
    q = (blocks / scale[:, None, :, None]).reshape(nb * FP8_BLOCK, kb * FP8_BLOCK)[:n, :k]
    return q.to(FP8_DTYPE).contiguous(), scale.contiguous()


def _expand_block_scale(scale: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """``[..., nb, kb]`` block scales -> ``[..., n, k]`` elementwise scales."""
    s = scale.float().repeat_interleave(FP8_BLOCK, dim=-2)[..., :n, :]
    return s.repeat_interleave(FP8_BLOCK, dim=-1)[..., :k]


def dequantize_weight_128x128(
    q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``W[..., i, j] = q[..., i, j] * scale_inv[..., i // 128, j // 128]`` (leading group dims allowed)."""
    n, k = q.shape[-2], q.shape[-1]
    nb, kb = ceil_div(n, FP8_BLOCK), ceil_div(k, FP8_BLOCK)
    if tuple(scale_inv.shape[-2:]) != (nb, kb):
        raise ValueError(
            f"weight scale shape {tuple(scale_inv.shape)} does not match weight {tuple(q.shape)}: "
            f"expected [..., {nb}, {kb}]"
        )
    return (q.float() * _expand_block_scale(scale_inv, n, k)).to(dtype)


def fp8_gemm_nt(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """Reference of DeepGEMM's dense FP8 GEMM: ``out = (a * sa) @ (b * sb)^T`` accumulated in fp32.

    ``a`` fp8 ``[m, k]`` with 1x128 scales ``[m, ceil(k/128)]``; ``b`` fp8 ``[n, k]`` with 128x128
    scales ``[ceil(n/128), ceil(k/128)]``; ``out`` ``[m, n]`` (any float dtype) is written and returned.
    """
    a_hp = dequantize_activation_1x128(a, a_scale)
    b_hp = dequantize_weight_128x128(b, b_scale)
    out.copy_(a_hp @ b_hp.t())
    return out
