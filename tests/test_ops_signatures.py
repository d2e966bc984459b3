"""Every backend of every kernel entry point has the signature of its Protocol
(dsinfer/ops/signatures.py): parameter names, kinds, defaults and annotations, and the return
annotation. GPU-only backends are checked by their Python signatures (nothing is launched)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import pytest

from dsinfer.ops import (
    experts,
    gate,
    gemm,
    indexer,
    mla,
    mxfp4,
    norm,
    sampling,
    signatures,
    sparse_mla,
    v4_compress,
)
from dsinfer.ops.external import DeepGemmAdapter, FlashMlaAdapter
from dsinfer.ops.external_fp4 import DeepGemmMxfp4Adapter
from dsinfer.ops.external_sparse import DeepGemmIndexerAdapter, FlashMlaSparseAdapter


def _protocol(name: str) -> type:
    """The signature protocol of the entry point ``name`` (mla_decode -> MlaDecode)."""
    return getattr(signatures, name.title().replace("_", ""))


def _implementations() -> list[tuple[str, type, Callable[..., Any]]]:
    import dsinfer.kernels as kernels

    from dsinfer.ops import experts_cpu, gate_cpu, mla_cpu, norm_cpu

    backends: dict[str, list[Callable[..., Any]]] = {
        "torch": [gemm.linear, gemm.pack_linear_weight, gemm.grouped_gemm_contiguous, gemm.grouped_gemm_masked,
                  mla.mla_decode, mla.mla_decode_absorbed, gate.moe_gate, sampling.sample, experts.fused_experts, experts.masked_experts,
                  indexer.indexer_topk, sparse_mla.sparse_mla_decode, v4_compress.pool_windows,
                  mxfp4.mxfp4_grouped_gemm, norm.rms_norm],
        "numba": [mla_cpu.mla_decode, mla_cpu.mla_decode_absorbed, experts_cpu.fused_experts, norm_cpu.rms_norm, gate_cpu.moe_gate],
        "deepgemm": [DeepGemmAdapter.linear, DeepGemmAdapter.grouped_gemm_contiguous,
                     DeepGemmAdapter.grouped_gemm_masked, DeepGemmAdapter.masked_experts,
                     DeepGemmIndexerAdapter.indexer_topk, DeepGemmMxfp4Adapter.mxfp4_grouped_gemm],
        "flashmla": [FlashMlaAdapter.mla_decode, FlashMlaSparseAdapter.sparse_mla_decode],
        "triton": [kernels.mla_decode, kernels.moe_gate, kernels.sparse_mla_decode, kernels.pool_windows,
                   kernels.mxfp4_grouped_gemm],
    }  # fmt: skip
    impls = [(f"{b} {fn.__name__}", _protocol(fn.__name__), fn) for b, fns in backends.items() for fn in fns]
    grouped = functools.partial(experts.grouped_experts, gemm.grouped_gemm_contiguous)
    impls.append(("grouped fused_experts", signatures.FusedExperts, grouped))
    # the Triton indexer computes the logits; the entry point adds the shared top-k
    impls.append(
        ("triton indexer_topk", signatures.IndexerTopk, indexer.indexer_topk_with(kernels.indexer_logits))
    )
    # every mla_decode but the CPU kernel's is wrapped in the absorbed path's two batched GEMMs
    absorbed = mla.mla_decode_absorbed_with(kernels.mla_decode)
    impls.append(("triton mla_decode_absorbed", signatures.MlaDecodeAbsorbed, absorbed))
    return impls


def _shape(fn: Callable[..., Any], drop_self: bool) -> tuple[list[tuple[str, Any, Any, str]], str]:
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    if drop_self and params and params[0].name == "self":
        params = params[1:]
    return [(p.name, p.kind, p.default, str(p.annotation)) for p in params], str(sig.return_annotation)


@pytest.mark.parametrize(
    ("name", "protocol", "impl"), _implementations(), ids=lambda x: x if isinstance(x, str) else ""
)
def test_backend_has_its_protocols_signature(name: str, protocol: type, impl: Callable[..., Any]) -> None:
    assert _shape(impl, drop_self=True) == _shape(protocol.__call__, drop_self=True), name


def test_every_ops_field_is_typed_by_a_protocol() -> None:
    from dsinfer.ops.backend import Ops

    kernels = {f for f, t in Ops.__annotations__.items() if t in signatures.__all__}
    assert kernels == {
        "linear", "pack_linear_weight", "grouped_gemm_contiguous", "grouped_gemm_masked", "fused_experts",
        "masked_experts", "mla_decode", "mla_decode_absorbed", "moe_gate", "sample",
        "indexer_topk", "sparse_mla_decode", "pool_windows", "mxfp4_grouped_gemm", "rms_norm",
    }  # fmt: skip
