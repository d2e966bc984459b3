"""What the latent-attention kernels share (``mla_decode``, ``mla_decode_tma``, ``sparse_mla``): the
float types they take, the online softmax over key tiles in log2 units, and the channel split of
the latent cache (values, then rope) as launch constants."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["FLOAT_DTYPES", "LOG2E", "channel_constants", "online_softmax_finish", "online_softmax_step"]

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LOG2E = 1.4426950408889634  # scores are scaled by softmax_scale * LOG2E: the kernels use exp2


@triton.jit
def online_softmax_step(scores, m_i, l_i):
    """One key tile of scores ``[rows, keys]`` (log2 units, -inf where not visible) into the running
    max ``m_i`` and sum ``l_i``: ``(p, alpha, m_new, l_new)``, ``acc`` becomes ``acc * alpha + p @ V``."""
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(scores - m_ref[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def online_softmax_finish(acc, m_i, l_i):
    """``(out, lse, seen)``: the normalised output, the natural-log log-sum-exp, and which rows saw
    a key (an unseen row has ``out`` 0 and an lse the caller replaces)."""
    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453  # ln 2: back to natural log
    return out, lse, seen


def channel_constants(head_dim_v: int, dim: int) -> dict[str, int]:
    """The launch constants of a ``dim``-channel latent cache whose first ``head_dim_v`` channels
    are the values: ``DV``, ``DPE`` (the rope channels) and their power-of-two blocks."""
    dpe = dim - head_dim_v
    return {
        "DV": head_dim_v,
        "DPE": dpe,
        "BLOCK_DV": max(16, triton.next_power_of_2(head_dim_v)),
        "BLOCK_PE": max(16, triton.next_power_of_2(max(dpe, 1))),
    }
