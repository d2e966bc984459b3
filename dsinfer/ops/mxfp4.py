"""MXFP4 (OCP microscaling FP4): DeepSeek-V4's routed-expert weights in its instruct checkpoints.

Each element is e2m1 (values 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives), two per byte with
the even element in the low nibble; each run of 32 elements along a row shares one e8m0 scale
(a power of two: ``2 ** (byte - 127)``). The packing order is the common one (OCP reference,
gpt-oss); it is not yet checked against a released V4 file.
"""

from __future__ import annotations

import torch

MX_BLOCK = 32
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E2M1_EMAX = 2  # 6 = 1.5 * 2**2


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """e8m0 scales (``float8_e8m0fnu``, or their raw bytes as uint8) -> float32 powers of two."""
    if scale.dtype == torch.uint8:
        return torch.exp2(scale.float() - 127.0)
    return scale.float()


def dequantize_mxfp4(
    packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``packed`` uint8/int8 ``[..., n, k/2]`` and ``scale`` ``[..., n, k/32]`` -> ``[..., n, k]``."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    nibbles = packed.view(torch.uint8)
    values = torch.stack([table[(nibbles & 0x0F).long()], table[(nibbles >> 4).long()]], dim=-1).flatten(-2)
    blocks = values.unflatten(-1, (-1, MX_BLOCK)) * scale_to_float(scale).unsqueeze(-1)
    return blocks.flatten(-2).to(dtype)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [..., n, k]`` (k a multiple of 32) -> (packed uint8 ``[..., n, k/2]``, e8m0 scales
    ``[..., n, k/32]``), each element rounded to the nearest e2m1 value of its block's scale."""
    blocks = w.float().unflatten(-1, (-1, MX_BLOCK))
    amax = blocks.abs().amax(-1).clamp_min(2.0**-126)
    exponent = torch.floor(torch.log2(amax)) - E2M1_EMAX
    scaled = blocks / torch.exp2(exponent).unsqueeze(-1)
    table = torch.tensor(E2M1_VALUES[:8], dtype=torch.float32, device=w.device)
    magnitude = (scaled.abs().clamp(max=6.0).unsqueeze(-1) - table).abs().argmin(-1)
    codes = (magnitude | ((scaled < 0).long() << 3)).flatten(-2).to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, torch.exp2(exponent).to(torch.float8_e8m0fnu)


def mxfp4_grouped_gemm(
    a: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, expert_of_row: torch.Tensor
) -> torch.Tensor:
    """Rows of ``a [M, K]`` through their experts' MXFP4 weights: ``d[m] = a[m] @ W[e].T`` with
    ``W[e]`` the dequantised ``b [G, N, K/2]`` under ``b_scale [G, N, K/32]`` and ``e =
    expert_of_row[m]``; rows of expert -1 are zero. Float32 accumulation, ``a``'s dtype out (the
    torch reference of ``Ops.mxfp4_grouped_gemm``; kernels/mxfp4_gemm.py dequantises in the
    kernel)."""
    if a.dim() != 2 or b.dim() != 3 or b.shape[2] * 2 != a.shape[1] or b_scale.shape[:2] != b.shape[:2]:
        raise ValueError(
            f"a must be [M, K], b [G, N, K/2] and b_scale [G, N, K/32], got {tuple(a.shape)}, "
            f"{tuple(b.shape)}, {tuple(b_scale.shape)}"
        )
    out = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float32, device=a.device)
    for expert in expert_of_row.unique().tolist():
        if expert < 0:
            continue
        rows = (expert_of_row == expert).nonzero(as_tuple=True)[0]
        weight = dequantize_mxfp4(b[expert], b_scale[expert], torch.float32)
        out[rows] = a[rows].float() @ weight.T
    return out.to(a.dtype)
