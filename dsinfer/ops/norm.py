"""RMSNorm, the torch reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x [..., D]`` normalised over its last dimension, times ``weight [D]``.

    The normalisation is computed in fp32. float32 ``x`` and ``weight``: ``x * rsqrt(mean(x^2) +
    eps) * weight``. Any other dtype: the normalised ``x`` is rounded to ``x``'s dtype before the
    weight multiplies it, as transformers' DeepseekV3RMSNorm does (the result takes the two
    dtypes' promotion). Each row's result depends on that row alone."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)
