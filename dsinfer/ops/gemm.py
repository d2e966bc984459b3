"""GEMM entry points (dense linear, grouped expert GEMMs): torch references with DeepGEMM semantics.

When the weight is float8 e4m3fn with 128x128 block scales, the activation is quantized per token
per 128 channels (1x128) exactly as DeepGEMM's callers do, and the product is computed from the
dequantized operands with fp32 accumulation. High-precision weights use a plain matmul in the
activation's dtype. Outputs always have the activation's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsinfer.ops.fp8 import (
    FP8_DTYPE,
    dequantize_activation_1x128,
    dequantize_weight_128x128,
    fp8_gemm_nt,
    quantize_activation_1x128,
)

__all__ = ["grouped_gemm_contiguous", "grouped_gemm_masked", "linear", "pack_linear_weight", "packed_pays"]


def _is_fp8(t: torch.Tensor) -> bool:
    return t.dtype == FP8_DTYPE


def _check_fp8_scale(weight: torch.Tensor, scale: torch.Tensor | None, name: str) -> torch.Tensor:
    if scale is None:
        raise ValueError(f"{name}: float8 weight of shape {tuple(weight.shape)} needs its block scales")
    return scale


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` [n, k] in the form :func:`linear` runs fastest for activations of its dtype, or
    None where the plain weight is that form. Only weights on a CPU have another:

    - bf16, where oneDNN has bf16 GEMMs (AVX-512 BF16, AMX): the weight reordered once into its
      blocked layout. A bf16 ``F.linear`` runs the same kernel but reorders the weight at every
      call; the packed weight skips that, with bit-identical results (here 15-35% less time per
      GEMM of 64 rows, 2-4.5% more bf16 tokens/s of the offline engine on the tiny preset:
      benchmarks/packed_linear.py);
    - bf16 elsewhere (AVX2 only): the weight widened to float32 (exactly), and packed as a float32
      weight is: ATen's own bf16 GEMM there took 4-6x the time of widening the activations and
      running oneDNN's float32 GEMM (benchmarks/README.md), at twice the weight's memory;
    - float32, of ``PACKED_F32_MIN_ELEMENTS`` or more: oneDNN's blocked layout. ATen's float32
      GEMM (MKL) repacks the weight at every call, and on AMD CPUs runs an AVX2 kernel; oneDNN's
      packed GEMM took 0.5-0.9x its time at 16-256 rows on an AMD EPYC (AVX-512), and gives each
      row the same bits whatever the number of rows (MKL's differ at 1-5 rows)."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.bfloat16, torch.float32):
        return None
    onednn = torch.backends.mkldnn.is_available()
    widened = weight.dtype == torch.bfloat16
    if widened:
        if onednn and torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return torch.ops.mkldnn._reorder_linear_weight(weight, None)
        weight = weight.float()
    if onednn and weight.numel() >= PACKED_F32_MIN_ELEMENTS:
        return torch.ops.mkldnn._reorder_linear_weight(weight, None)
    return weight if widened else None


# Elements (n * k) from which a float32 weight takes oneDNN's packed layout. Smaller ones run
# faster through MKL at few rows: oneDNN's call costs ~15 us more, which only large weights win
# back at one row. On an AMD EPYC (AVX-512, 2 threads), oneDNN / MKL time at 64 rows and at one
# (benchmarks/results/gemm_f32_paths_epyc.md): 576x256 0.61x and 1.59x; 4096x256 0.51x and 0.50x;
# 256x256 0.77x and 3.0x; 256x128 0.79x and 3.6x. With the 576x256 ones packed the tiny preset's
# batch-1 step still gains from its 4096-row head; packing every weight cost 6-9% at batch 1.
PACKED_F32_MIN_ELEMENTS = 131072

# Rows from which a bf16 linear takes the weight widened to float32, on a CPU without bf16 GEMMs.
# Below them ATen's bf16 GEMM, which reads half the bytes, is faster. Measured on the tiny
# preset in the engine, AVX2 emulated on an AMD EPYC (ONEDNN_MAX_CPU_ISA=AVX2,
# ATEN_CPU_CAPABILITY=avx2): widened / bf16 was 0.65x at 2 rows, 0.90x at 8, 1.08x at 16 and
# 1.53x at 64.
WIDENED_MIN_ROWS = 16


def packed_pays(x: torch.Tensor, packed: torch.Tensor) -> bool:
    """Whether :func:`linear` should take ``packed`` (from :func:`pack_linear_weight`) rather
    than the plain weight for ``x``: a form of ``x``'s own dtype always, a bf16 weight widened to
    float32 from ``WIDENED_MIN_ROWS`` rows on."""
    return packed.dtype == x.dtype or x.numel() >= WIDENED_MIN_ROWS * x.shape[-1]


def linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor | None = None
) -> torch.Tensor:
    """``y[..., n] = x[..., k] @ weight[n, k]^T``; block-FP8 weights go through :func:`fp8_gemm_nt`;
    a weight from :func:`pack_linear_weight` through oneDNN's packed GEMM, or, for a bf16 ``x``
    and a weight widened to float32, in float32 with the output rounded to bf16 (as a bf16 GEMM
    rounds it)."""
    if x.dtype == torch.bfloat16 and weight.dtype == torch.float32:
        return linear(x.float(), weight).to(torch.bfloat16)
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
    if not _is_fp8(weight):
        return F.linear(x, weight if weight.dtype == x.dtype else weight.to(x.dtype))
    scale = _check_fp8_scale(weight, weight_scale_inv, "linear")
    lead, k = x.shape[:-1], x.shape[-1]
    n = weight.shape[0]
    x2 = x.reshape(-1, k)
    q, sa = quantize_activation_1x128(x2)
    out = torch.empty(x2.shape[0], n, dtype=torch.float32, device=x.device)
    fp8_gemm_nt(q, sa, weight, scale, out)
    return out.to(x.dtype).reshape(*lead, n)


def _prepare_activation(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a`` as the GEMM sees it: 1x128-quantized (in fp32) when ``b`` is fp8, else as it is
    (a bf16 GEMM on CPU accumulates in fp32, as DeepGEMM does)."""
    if _is_fp8(b):
        q, s = quantize_activation_1x128(a)
        return dequantize_activation_1x128(q, s)
    return a


def _group_weight(
    b: torch.Tensor, b_scale: torch.Tensor | None, g: int | slice, dtype: torch.dtype
) -> torch.Tensor:
    if _is_fp8(b):
        scale = _check_fp8_scale(b, b_scale, "grouped gemm")
        return dequantize_weight_128x128(b[g], scale[g])
    return b[g].to(dtype)


def grouped_gemm_contiguous(
    a: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor | None,
    m_indices: torch.Tensor,
) -> torch.Tensor:
    """Contiguous-layout grouped GEMM: ``out[i] = a[i] @ b[m_indices[i]]^T``; rows with index -1 -> 0.

    ``a`` ``[m_sum, k]`` high precision, ``b`` ``[G, n, k]`` (fp8 with ``b_scale [G, nb, kb]`` or
    high precision), ``m_indices`` int32 ``[m_sum]``. Returns ``[m_sum, n]`` in ``a``'s dtype.
    """
    m_sum, n = a.shape[0], b.shape[1]
    a_hp = _prepare_activation(a, b)
    out = torch.zeros(m_sum, n, dtype=a_hp.dtype, device=a.device)
    if m_sum == 0:
        return out.to(a.dtype)
    idx = m_indices.long()
    if bool((idx[1:] >= idx[:-1]).all()):  # sorted by group (DeepGEMM's layout): slice the segments
        counts = torch.bincount(idx.clamp(min=0), minlength=b.shape[0]).tolist()
        start = int((idx < 0).sum())  # sorted: padding rows (-1) come first
        counts[0] -= start
        if max(counts) * len(counts) <= 2 * (m_sum - start):  # balanced enough: one padded batched GEMM
            return _padded_bmm(a_hp, b, b_scale, idx[start:], counts, out, start).to(a.dtype)
        for g, count in enumerate(counts):
            if count:
                torch.mm(
                    a_hp[start : start + count],
                    _group_weight(b, b_scale, g, a_hp.dtype).t(),
                    out=out[start : start + count],
                )
                start += count
        return out.to(a.dtype)
    # Otherwise loop over the groups that occur (at most G), never over tokens.
    for g in torch.unique(idx[idx >= 0]).tolist():
        rows = (idx == g).nonzero().squeeze(1)
        out.index_copy_(0, rows, a_hp.index_select(0, rows) @ _group_weight(b, b_scale, g, a_hp.dtype).t())
    return out.to(a.dtype)


def _padded_bmm(
    a: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor | None,
    idx: torch.Tensor,
    counts: list[int],
    out: torch.Tensor,
    start: int,
) -> torch.Tensor:
    """Rows ``a[start:]`` sorted by group ``idx``: scatter into ``[G, max(counts), k]``, one bmm, gather."""
    firsts = torch.tensor([0, *counts[:-1]], device=a.device).cumsum(0)
    within = torch.arange(idx.shape[0], device=a.device) - firsts[idx]
    padded = a.new_zeros(len(counts), max(counts), a.shape[1])
    padded[idx, within] = a[start:]
    product = torch.bmm(padded, _group_weight(b, b_scale, slice(None), a.dtype).transpose(1, 2))
    out[start:] = product[idx, within]
    return out


def grouped_gemm_masked(
    a: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor | None,
    masked_m: torch.Tensor,
    expected_m: int,
) -> torch.Tensor:
    """Masked-layout grouped GEMM: ``out[g, :masked_m[g]] = a[g, :masked_m[g]] @ b[g]^T``.

    ``a`` ``[G, m_max, k]``, ``b`` ``[G, n, k]``, ``masked_m`` int32 ``[G]``. Rows at or beyond
    ``masked_m[g]`` are undefined in DeepGEMM; this reference writes zeros there (also when the
    padding rows of ``a`` hold garbage). ``expected_m`` is a performance hint and is ignored.
    Batched and free of host synchronisation.
    """
    del expected_m
    num_groups, m_max, _ = a.shape
    n = b.shape[1]
    if num_groups == 0 or m_max == 0:
        return torch.zeros(num_groups, m_max, n, dtype=a.dtype, device=a.device)
    a_hp = _prepare_activation(a, b)
    valid = torch.arange(m_max, device=a.device)[None, :] < masked_m.to(a.device).long()[:, None]
    a_hp = torch.where(valid[..., None], a_hp, 0.0)
    out = torch.bmm(a_hp, _group_weight(b, b_scale, slice(None), a_hp.dtype).transpose(1, 2))
    return torch.where(valid[..., None], out, 0.0).to(a.dtype)
