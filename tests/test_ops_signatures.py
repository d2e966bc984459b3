"""Every backend of every kernel entry point has the signature of its Protocol
(dsinfer/ops/signatures.py): parameter names, kinds, defaults and annotations, and the return
annotation. GPU-only backends are checked by their Python signatures (nothing is launched)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import pytest

from dsinfer.ops import experts, gate, gemm, indexer, mla, sampling, signatures, sparse_mla
from dsinfer.ops.external import DeepGemmAdapter, FlashMlaAdapter
from dsinfer.ops.external_sparse import DeepGemmIndexerAdapter, FlashMlaSparseAdapter


def _implementations() -> list[tuple[str, type, Callable[..., Any]]]:
    from dsinfer.ops import experts_cpu, mla_cpu

    impls: list[tuple[str, type, Callable[..., Any]]] = [
        ("torch linear", signatures.Linear, gemm.linear),
        ("torch pack_linear_weight", signatures.PackLinearWeight, gemm.pack_linear_weight),
        ("torch grouped_gemm_contiguous", signatures.GroupedGemmContiguous, gemm.grouped_gemm_contiguous),
        ("torch grouped_gemm_masked", signatures.GroupedGemmMasked, gemm.grouped_gemm_masked),
        ("torch mla_decode", signatures.MlaDecode, mla.mla_decode),
        ("torch moe_gate", signatures.MoeGate, gate.moe_gate),
        ("torch sample", signatures.Sample, sampling.sample),
        ("numba mla_decode", signatures.MlaDecode, mla_cpu.mla_decode),
        ("torch fused_experts", signatures.FusedExperts, experts.fused_experts),
        ("numba fused_experts", signatures.FusedExperts, experts_cpu.fused_experts),
        (
            "grouped fused_experts",
            signatures.FusedExperts,
            functools.partial(experts.grouped_experts, gemm.grouped_gemm_contiguous),
        ),
        ("deepgemm linear", signatures.Linear, DeepGemmAdapter.linear),
        ("deepgemm contiguous", signatures.GroupedGemmContiguous, DeepGemmAdapter.grouped_gemm_contiguous),
        ("deepgemm masked", signatures.GroupedGemmMasked, DeepGemmAdapter.grouped_gemm_masked),
        ("flashmla mla_decode", signatures.MlaDecode, FlashMlaAdapter.mla_decode),
        ("torch indexer_topk", signatures.IndexerTopk, indexer.indexer_topk),
        ("torch sparse_mla_decode", signatures.SparseMlaDecode, sparse_mla.sparse_mla_decode),
        ("deepgemm indexer_topk", signatures.IndexerTopk, DeepGemmIndexerAdapter.indexer_topk),
        ("flashmla sparse_mla_decode", signatures.SparseMlaDecode, FlashMlaSparseAdapter.sparse_mla_decode),
    ]
    import dsinfer.kernels as kernels

    for name, protocol in (
        ("mla_decode", signatures.MlaDecode),
        ("moe_gate", signatures.MoeGate),
        ("sparse_mla_decode", signatures.SparseMlaDecode),
    ):
        impls.append((f"triton {name}", protocol, getattr(kernels, name)))
    # the Triton indexer computes the logits; the entry point adds the shared top-k
    impls.append(
        ("triton indexer_topk", signatures.IndexerTopk, indexer.indexer_topk_with(kernels.indexer_logits))
    )
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
        "mla_decode", "moe_gate", "sample",
        "indexer_topk", "sparse_mla_decode",
    }  # fmt: skip
