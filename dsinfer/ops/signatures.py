"""The kernel entry points as types: one Protocol per entry point, whose call signature is its
reference implementation's, written once.

``Ops`` (dsinfer/ops/backend.py) holds one implementation per entry point, typed by these
Protocols. Each reference (the torch ones beside this file; the fused CPU experts) states the
contract in its docstring; every other backend (numba, the project's Triton kernels, the DeepGEMM
and FlashMLA adapters) takes the same parameters, which tests/test_ops_signatures.py checks, and
points here instead of restating it.
"""

from __future__ import annotations

from typing import Protocol

from dsinfer.ops import experts, gate, gemm, indexer, mla, mxfp4, norm, sampling, sparse_mla, v4_compress

__all__ = [
    "FusedExperts",
    "GroupedGemmContiguous",
    "GroupedGemmMasked",
    "IndexerTopk",
    "Linear",
    "MaskedExperts",
    "MlaDecode",
    "MlaDecodeAbsorbed",
    "MoeGate",
    "Mxfp4GroupedGemm",
    "PackLinearWeight",
    "PoolWindows",
    "RmsNorm",
    "Sample",
    "SparseMlaDecode",
]


class Linear(Protocol):
    """Block-FP8 (or plain) ``x @ weight^T``: :func:`dsinfer.ops.gemm.linear`."""

    __call__ = staticmethod(gemm.linear)


class PackLinearWeight(Protocol):
    """A weight pre-packed for :class:`Linear`, or None: :func:`dsinfer.ops.gemm.pack_linear_weight`."""

    __call__ = staticmethod(gemm.pack_linear_weight)


class GroupedGemmContiguous(Protocol):
    """DeepGEMM's contiguous-layout grouped GEMM: :func:`dsinfer.ops.gemm.grouped_gemm_contiguous`."""

    __call__ = staticmethod(gemm.grouped_gemm_contiguous)


class GroupedGemmMasked(Protocol):
    """DeepGEMM's masked-layout grouped GEMM: :func:`dsinfer.ops.gemm.grouped_gemm_masked`."""

    __call__ = staticmethod(gemm.grouped_gemm_masked)


class FusedExperts(Protocol):
    """Rows through the SwiGLU experts of their local slots: :func:`dsinfer.ops.experts.fused_experts`."""

    __call__ = staticmethod(experts.fused_experts)


class MaskedExperts(Protocol):
    """The SwiGLU experts over DeepGEMM's masked layout: :func:`dsinfer.ops.experts.masked_experts`."""

    __call__ = staticmethod(experts.masked_experts)


class MlaDecode(Protocol):
    """FlashMLA's paged MLA decode: :func:`dsinfer.ops.mla.mla_decode`."""

    __call__ = staticmethod(mla.mla_decode)


class MlaDecodeAbsorbed(Protocol):
    """MLA's absorbed decode (query and output folds around ``MlaDecode``):
    :func:`dsinfer.ops.mla.mla_decode_absorbed`."""

    __call__ = staticmethod(mla.mla_decode_absorbed)


class IndexerTopk(Protocol):
    """DeepSeek-V3.2's lightning indexer over the paged key cache, then top-k:
    :func:`dsinfer.ops.indexer.indexer_topk`."""

    __call__ = staticmethod(indexer.indexer_topk)


class SparseMlaDecode(Protocol):
    """FlashMLA's token-level sparse MLA decode: :func:`dsinfer.ops.sparse_mla.sparse_mla_decode`."""

    __call__ = staticmethod(sparse_mla.sparse_mla_decode)


class MoeGate(Protocol):
    """DeepSeek's noaux_tc routing: :func:`dsinfer.ops.gate.moe_gate`."""

    __call__ = staticmethod(gate.moe_gate)


class PoolWindows(Protocol):
    """DeepSeek-V4's compressor pooling: :func:`dsinfer.ops.v4_compress.pool_windows`."""

    __call__ = staticmethod(v4_compress.pool_windows)


class Mxfp4GroupedGemm(Protocol):
    """Rows through their experts' MXFP4 weights: :func:`dsinfer.ops.mxfp4.mxfp4_grouped_gemm`."""

    __call__ = staticmethod(mxfp4.mxfp4_grouped_gemm)


class RmsNorm(Protocol):
    """RMSNorm over the last dimension, times the weight: :func:`dsinfer.ops.norm.rms_norm`."""

    __call__ = staticmethod(norm.rms_norm)


class Sample(Protocol):
    """The counter-based sampler: :func:`dsinfer.ops.sampling.sample`."""

    __call__ = staticmethod(sampling.sample)
