"""The signature and contract of every kernel entry point, one Protocol each.

``Ops`` (dsinfer/ops/backend.py) holds one implementation per entry point, typed by these
Protocols; every backend (the torch references beside this file, the numba CPU kernels, the
project's Triton kernels, the DeepGEMM and FlashMLA adapters) implements them with the same
parameters, which tests/test_ops_signatures.py checks. Shapes: ``B`` sequences, ``T`` tokens,
``H`` hidden, ``G`` expert groups (slots), ``V`` vocabulary.
"""

from __future__ import annotations

from typing import Protocol

import torch

from dsinfer.ops.sampling import SamplingTensors

__all__ = [
    "FusedExperts",
    "GroupedGemmContiguous",
    "GroupedGemmMasked",
    "Linear",
    "MlaDecode",
    "MoeGate",
    "Sample",
]


class Linear(Protocol):
    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``y[..., n] = x[..., k] @ weight[n, k]^T`` in ``x``'s dtype; an FP8 ``weight`` comes with
        its fp32 128x128 block scales (DeepGEMM's ``fp8_gemm_nt``, activations 1x128-quantized)."""
        ...


class GroupedGemmContiguous(Protocol):
    def __call__(
        self, a: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor | None, m_indices: torch.Tensor
    ) -> torch.Tensor:
        """``out[i] = a[i] @ b[m_indices[i]]^T``: ``a [M, k]``, ``b [G, n, k]`` (FP8 with ``b_scale``
        ``[G, n/128, k/128]``, or high precision), ``m_indices`` int32 ``[M]``; rows whose index is
        -1 are zero. ``[M, n]`` in ``a``'s dtype (DeepGEMM's contiguous layout)."""
        ...


class GroupedGemmMasked(Protocol):
    def __call__(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        b_scale: torch.Tensor | None,
        masked_m: torch.Tensor,
        expected_m: int,
    ) -> torch.Tensor:
        """``out[g, :masked_m[g]] = a[g, :masked_m[g]] @ b[g]^T``: ``a [G, m_max, k]``, ``b [G, n, k]``,
        ``masked_m`` int32 ``[G]``; rows at or past ``masked_m[g]`` are undefined (the reference
        writes zeros); ``expected_m`` is a performance hint. No host synchronisation."""
        ...


class FusedExperts(Protocol):
    def __call__(
        self,
        rows: torch.Tensor,
        slots: torch.Tensor,
        w13: torch.Tensor,
        w13_scale_inv: torch.Tensor | None,
        w2: torch.Tensor,
        w2_scale_inv: torch.Tensor | None,
    ) -> torch.Tensor:
        """Each row ``[M, H]`` through the SwiGLU expert of its local slot (``slots [M]``): ``w13``
        ``[S, 2I, H]`` (gate rows, then up rows), ``w2`` ``[S, H, I]``; ``[M, H]`` in ``rows``'
        dtype and order. A row's result does not depend on the other rows."""
        ...


class MlaDecode(Protocol):
    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        block_table: torch.Tensor,
        cache_seqlens: torch.Tensor,
        head_dim_v: int,
        softmax_scale: float,
        causal: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Paged MLA decode attention with FlashMLA's semantics (dsinfer/ops/mla.py has them in
        full): ``q [B, s_q, h_q, D]`` over ``k_cache [blocks, page, 1, D]`` through ``block_table
        [B, max_pages]`` and ``cache_seqlens [B]`` -> ``(out [B, s_q, h_q, head_dim_v], lse fp32
        [B, h_q, s_q])``."""
        ...


class MoeGate(Protocol):
    def __call__(
        self,
        router_logits: torch.Tensor,
        bias: torch.Tensor | None,
        top_k: int,
        n_group: int,
        topk_group: int,
        norm_topk_prob: bool,
        routed_scaling_factor: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSeek's noaux_tc routing of ``T`` tokens over ``E`` experts -> ``(weights fp32 [T,
        top_k], ids int64 [T, top_k])``, ids by descending choice score (dsinfer/ops/gate.py)."""
        ...


class Sample(Protocol):
    def __call__(self, logits: torch.Tensor, params: SamplingTensors, draw: int = 0) -> torch.Tensor:
        """One token per row of ``logits`` (fp32 ``[B, V]``) -> int64 ``[B]``, drawn from the
        counter-based generator keyed by (seed, choice, position, ``draw``) (dsinfer/ops/sampling.py)."""
        ...
