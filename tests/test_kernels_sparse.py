"""The Triton indexer-logits and sparse-MLA kernels of dsinfer.kernels against their torch references
(dsinfer/ops/indexer.py, dsinfer/ops/sparse_mla.py), on CPU under ``TRITON_INTERPRET=1``.

As tests/test_kernels_gemm.py explains, the checks run in one fresh interpreter (``python -m
tests.test_kernels_sparse`` prints the JSON of results); each check also counts the jitted kernel's
launches, so a wrapper that answered without running Triton fails. Unused cache slots hold NaN:
nothing outside the visible or picked keys may reach a result.
"""

from __future__ import annotations

import importlib
import inspect
import json

import pytest
import torch

from tests.test_kernels_gemm import launches, run_checks, subprocess_checks
from tests.test_ops_sparse import PS
from tests.test_ops_sparse import paged_cache as _paged

pytestmark = pytest.mark.system


def _module(name: str) -> object:
    return importlib.import_module(f"dsinfer.kernels.{name}")  # the package re-exports its function


def _check_logits(
    q: torch.Tensor, weights: torch.Tensor, cache: torch.Tensor, table, lens, tol: float
) -> None:  # type: ignore[no-untyped-def]
    from dsinfer.kernels import indexer_logits

    from dsinfer.ops.indexer import indexer_logits as reference

    with launches(_module("indexer")._indexer_logits_kernel) as calls:  # type: ignore[attr-defined]
        got = indexer_logits(q, weights, cache, table, lens)
    assert calls == [1], calls
    ref = reference(q, weights, cache, table, lens)
    visible = torch.isfinite(ref)
    assert torch.equal(visible, torch.isfinite(got)), "-inf pattern differs"
    torch.testing.assert_close(got[visible], ref[visible], rtol=tol, atol=tol)


def check_indexer_plain_fp32() -> None:
    gen = torch.Generator().manual_seed(1)
    cache, table, lens = _paged([5, 40, 1, 23], 24, gen, torch.float32)
    q = torch.randn(4, 2, 6, 24, generator=gen)
    _check_logits(q, torch.randn(4, 2, 6, generator=gen), cache, table, lens, 1e-5)


def check_indexer_bf16_cache_strided_query() -> None:
    gen = torch.Generator().manual_seed(2)
    cache, table, lens = _paged([17, 33], 32, gen, torch.bfloat16)
    q = torch.randn(2, 3, 10, 32, generator=gen)[:, :, ::2]  # strided heads
    _check_logits(q, torch.randn(2, 3, 5, generator=gen), cache, table, lens, 1e-4)


def check_indexer_fp8_cache_and_query() -> None:
    """DeepSeek's release format: e4m3 keys with per-key scales in DeepGEMM's page layout, e4m3
    queries with their scales folded into the weights."""
    from dsinfer.ops import indexer as ix

    gen = torch.Generator().manual_seed(3)
    plain, table, lens = _paged([9, 60, 31], 64, gen, torch.float32)
    fp8 = torch.zeros(plain.shape[0], PS, 64 + ix.SCALE_BYTES, dtype=torch.uint8)
    slots = torch.arange(plain.shape[0] * PS)
    ix.write_keys(fp8, slots, ix.hadamard(plain.view(-1, 64).nan_to_num(0.0)))
    q8, q_scale = ix.quantize_per_row(ix.hadamard(torch.randn(3, 1, 16, 64, generator=gen)))
    weights = torch.rand(3, 1, 16, generator=gen) * q_scale
    _check_logits(q8, weights, fp8, table, lens, 1e-5)


def check_indexer_topk_entry_point() -> None:
    """The ops entry point over the kernel picks what the reference picks."""
    from dsinfer.kernels import indexer_logits

    from dsinfer.ops.indexer import indexer_topk, indexer_topk_with

    gen = torch.Generator().manual_seed(4)
    cache, table, lens = _paged([70, 12, 45], 16, gen, torch.float32)
    q, weights = torch.randn(3, 2, 4, 16, generator=gen), torch.randn(3, 2, 4, generator=gen)
    got = indexer_topk_with(indexer_logits)(q, weights, cache, table, lens, 20)
    assert torch.equal(got, indexer_topk(q, weights, cache, table, lens, 20))
    assert bool((got[1] == -1).any()), "a short sequence pads its picks with -1"


def _check_sparse(q: torch.Tensor, cache: torch.Tensor, indices: torch.Tensor, dv: int, tol: float) -> None:
    from dsinfer.kernels import sparse_mla_decode

    from dsinfer.ops.sparse_mla import sparse_mla_decode as reference

    with launches(_module("sparse_mla")._sparse_mla_kernel) as calls:  # type: ignore[attr-defined]
        out, lse = sparse_mla_decode(q, cache, indices, dv, 0.3)
    assert calls == [1], calls
    ref_out, ref_lse = reference(q, cache, indices, dv, 0.3)
    assert out.dtype == q.dtype and out.shape == ref_out.shape and lse.shape == ref_lse.shape
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-4)  # +inf rows too


def _indices(gen: torch.Generator, pages: int, shape: tuple[int, int, int], avoid: int) -> torch.Tensor:
    choices = torch.tensor([s for s in range(pages * PS) if s // PS != avoid])
    return choices[torch.randint(0, len(choices), shape, generator=gen)].to(torch.int32)


def check_sparse_mla_fp32() -> None:
    gen = torch.Generator().manual_seed(5)
    cache = torch.randn(12, PS, 1, 40, generator=gen)
    cache[4] = float("nan")  # never picked
    q = torch.randn(3, 2, 5, 40, generator=gen)
    indices = _indices(gen, 12, (3, 2, 37), avoid=4)
    indices[0, 1, 9:] = -1
    indices[2, 0] = -1  # nothing to attend to: out 0, lse +inf
    _check_sparse(q, cache, indices, 32, 1e-5)


def check_sparse_mla_v3_shape_bf16() -> None:
    gen = torch.Generator().manual_seed(6)
    cache = torch.randn(20, PS, 1, 576, generator=gen).bfloat16()
    q = torch.randn(2, 1, 16, 576, generator=gen).bfloat16()
    _check_sparse(q, cache, _indices(gen, 20, (2, 1, 64), avoid=-1), 512, 2e-2)


def check_sparse_v4_layout_all_channels_values() -> None:
    """DeepSeek-V4's attention core (dsinfer/model/v4_attention.py): one K=V row whose every channel
    is also the value (head_dim_v == D, no rope-only channels), over rows of one token each."""
    gen = torch.Generator().manual_seed(7)
    rows = torch.randn(90, 1, 1, 64, generator=gen)  # a window's raw rows and compressed entries
    q = torch.randn(1, 5, 8, 64, generator=gen)
    indices = torch.randint(0, 90, (1, 5, 24), generator=gen, dtype=torch.int32)
    indices[0, 3, 10:] = -1
    _check_sparse(q, rows, indices, 64, 1e-5)


def check_exports_and_edges() -> None:
    import dsinfer.kernels
    from dsinfer.kernels import indexer_logits, sparse_mla_decode

    from dsinfer.ops import indexer as ix
    from dsinfer.ops import sparse_mla
    from dsinfer.ops.backend import TRITON_FEATURES

    for name in (*TRITON_FEATURES["indexer"], *TRITON_FEATURES["sparse_mla"]):
        assert hasattr(dsinfer.kernels, name), name
    for kernel, ref in (
        (indexer_logits, ix.indexer_logits),
        (sparse_mla_decode, sparse_mla.sparse_mla_decode),
    ):
        positional = [p for p in inspect.signature(kernel).parameters.values() if p.kind != p.KEYWORD_ONLY]
        assert [p.name for p in positional] == list(inspect.signature(ref).parameters), kernel
    out, lse = sparse_mla_decode(
        torch.zeros(0, 1, 4, 24), torch.zeros(2, PS, 1, 24), torch.zeros(0, 1, 3), 16, 0.1
    )
    assert out.shape == (0, 1, 4, 16) and lse.shape == (0, 4, 1)
    for bad in ((torch.zeros(2, PS, 2, 24), 16), (torch.zeros(2, PS, 1, 24), 25)):
        with pytest.raises(ValueError):
            sparse_mla_decode(torch.zeros(1, 1, 4, 24), bad[0], torch.zeros(1, 1, 3), bad[1], 0.1)
    with pytest.raises(ValueError, match="4 bytes per key"):
        indexer_logits(
            torch.zeros(1, 1, 2, 16),
            torch.zeros(1, 1, 2),
            torch.zeros(2, PS, 16, dtype=torch.uint8),
            torch.zeros(1, 1, dtype=torch.int32),
            torch.ones(1),
        )


CHECKS = (
    check_indexer_plain_fp32,
    check_indexer_bf16_cache_strided_query,
    check_indexer_fp8_cache_and_query,
    check_indexer_topk_entry_point,
    check_sparse_mla_fp32,
    check_sparse_mla_v3_shape_bf16,
    check_sparse_v4_layout_all_channels_values,
    check_exports_and_edges,
)


results, test_kernel_check = subprocess_checks("tests.test_kernels_sparse", CHECKS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_kernels_on_gpu() -> None:
    from dsinfer.kernels import indexer_logits, sparse_mla_decode

    from dsinfer.ops import indexer as ix
    from dsinfer.ops import select_ops
    from dsinfer.ops.sparse_mla import sparse_mla_decode as reference

    ops = select_ops("cuda", prefer="triton")
    assert ops.backends["indexer"] == "triton" and ops.backends["sparse_mla"] == "triton"
    gen = torch.Generator().manual_seed(7)
    cache, table, lens = _paged([3000, 700, 64], 128, gen, torch.bfloat16)
    q = torch.randn(3, 1, 64, 128, generator=gen)
    weights = torch.randn(3, 1, 64, generator=gen)
    args = [t.cuda() for t in (q, weights, cache, table, lens)]
    got, ref = indexer_logits(*args), ix.indexer_logits(*args)
    visible = torch.isfinite(ref)
    assert torch.equal(visible, torch.isfinite(got))
    torch.testing.assert_close(got[visible], ref[visible], rtol=1e-3, atol=1e-3)
    kv = torch.randn(200, 64, 1, 576, generator=gen).bfloat16().cuda()
    qq = torch.randn(4, 1, 128, 576, generator=gen).bfloat16().cuda()
    idx = torch.randint(0, 200 * 64, (4, 1, 2048), generator=gen).to(torch.int32).cuda()
    out, _ = sparse_mla_decode(qq, kv, idx, 512, 0.1)
    torch.testing.assert_close(out.float(), reference(qq, kv, idx, 512, 0.1)[0].float(), rtol=2e-2, atol=2e-2)


if __name__ == "__main__":
    print(json.dumps(run_checks(CHECKS)))
