"""MLA decode over a paged latent cache against naive per-sequence attention in float64."""

from __future__ import annotations

import math
import types

import pytest
import torch

from dsinfer.ops import Ops, select_ops
from dsinfer.ops.backend import capability_unsupported
from dsinfer.ops.external import FlashMlaAdapter, flash_mla_api

D, DV, H = 24, 16, 3  # latent+rope dim, V dim (first DV channels), query heads


@pytest.fixture(params=["torch", "numba"])
def ops(request: pytest.FixtureRequest) -> Ops:
    """Both CPU implementations of mla_decode: the torch reference and the fused numba kernel."""
    ops = select_ops(torch.device("cpu"), prefer=request.param)
    assert ops.backends["mla"] == request.param, ops.backends
    return ops


def _paged_cache(seqlens: list[int], page_size: int, gen: torch.Generator):
    """Per-sequence latent tokens, scattered over shuffled pages; free pages and slots hold NaN."""
    pages_per_seq = [-(-n // page_size) for n in seqlens]
    num_blocks = sum(pages_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    k_cache = torch.full((num_blocks, page_size, 1, D), float("nan"))
    max_pages = max(max(pages_per_seq), 1) + 1  # one spare column, like a real table
    block_table = torch.full((len(seqlens), max_pages), -1, dtype=torch.int32)
    tokens = []
    used = 0
    for b, n in enumerate(seqlens):
        kv = torch.randn(n, D, generator=gen)
        tokens.append(kv)
        for p in range(pages_per_seq[b]):
            blk = int(perm[used])
            used += 1
            block_table[b, p] = blk
            chunk = kv[p * page_size : (p + 1) * page_size]
            k_cache[blk, : len(chunk), 0] = chunk
    return k_cache, block_table, tokens


def _naive(q: torch.Tensor, tokens: list[torch.Tensor], scale: float, causal: bool):
    bsz, s_q, h_q, _ = q.shape
    out = torch.zeros(bsz, s_q, h_q, DV, dtype=torch.float64)
    lse = torch.full((bsz, h_q, s_q), math.inf, dtype=torch.float64)
    for b in range(bsz):
        kv = tokens[b].double()
        n = kv.shape[0]
        for i in range(s_q):
            visible = n - s_q + i + 1 if causal else n
            if visible <= 0:
                continue
            for h in range(h_q):
                scores = (kv[:visible] @ q[b, i, h].double()) * scale
                lse[b, h, i] = torch.logsumexp(scores, 0)
                out[b, i, h] = torch.softmax(scores, 0) @ kv[:visible, :DV]
    return out, lse


@pytest.mark.parametrize(
    ("seqlens", "page_size", "s_q", "causal"),
    [
        ([5, 13, 1], 4, 1, False),  # ragged, partial last pages
        ([5, 13, 1], 4, 1, True),  # s_q = 1: causal changes nothing
        ([7, 2, 16], 4, 2, True),  # two query tokens, bottom-right causal mask
        ([9, 21], 8, 3, True),  # nine query rows: two blocks of four and one left over
        ([70, 3], 64, 2, False),  # production page size, partial second page
        ([0, 9], 8, 1, False),  # an empty sequence
    ],
)
def test_mla_decode_matches_naive(
    ops: Ops, seqlens: list[int], page_size: int, s_q: int, causal: bool
) -> None:
    gen = torch.Generator().manual_seed(sum(seqlens) + page_size + s_q)
    k_cache, block_table, tokens = _paged_cache(seqlens, page_size, gen)
    q = torch.randn(len(seqlens), s_q, H, D, generator=gen)
    scale = 0.3
    out, lse = ops.mla_decode(
        q, k_cache, block_table, torch.tensor(seqlens, dtype=torch.int32), DV, scale, causal
    )
    assert out.shape == (len(seqlens), s_q, H, DV) and out.dtype == q.dtype
    assert lse.shape == (len(seqlens), H, s_q) and lse.dtype == torch.float32
    ref_out, ref_lse = _naive(q, tokens, scale, causal)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)


def test_mla_decode_causal_query_with_no_key(ops: Ops) -> None:
    """A length-1 sequence with s_q = 2: the first query sees nothing -> out 0, lse +inf."""
    gen = torch.Generator().manual_seed(11)
    k_cache, block_table, tokens = _paged_cache([1], 4, gen)
    q = torch.randn(1, 2, H, D, generator=gen)
    out, lse = ops.mla_decode(q, k_cache, block_table, torch.tensor([1], dtype=torch.int32), DV, 0.5, True)
    assert (out[0, 0] == 0).all() and torch.isposinf(lse[0, :, 0]).all()
    ref_out, ref_lse = _naive(q, tokens, 0.5, True)
    torch.testing.assert_close(out[0, 1].double(), ref_out[0, 1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse[0, :, 1].double(), ref_lse[0, :, 1], rtol=1e-5, atol=1e-5)


def test_mla_decode_bf16_and_batch_independence(ops: Ops) -> None:
    gen = torch.Generator().manual_seed(12)
    seqlens = [9, 30, 4]
    k_cache, block_table, _ = _paged_cache(seqlens, 8, gen)
    q = torch.randn(3, 1, H, D, generator=gen)
    lens = torch.tensor(seqlens, dtype=torch.int32)
    out, lse = ops.mla_decode(q, k_cache, block_table, lens, DV, 0.2, False)
    for b in range(3):  # a row's result does not depend on the rest of the batch
        o1, l1 = ops.mla_decode(
            q[b : b + 1], k_cache, block_table[b : b + 1], lens[b : b + 1], DV, 0.2, False
        )
        torch.testing.assert_close(o1[0], out[b], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(l1[0], lse[b], rtol=1e-6, atol=1e-6)
    out16, _ = ops.mla_decode(q.bfloat16(), k_cache.bfloat16(), block_table, lens, DV, 0.2, False)
    assert out16.dtype == torch.bfloat16
    torch.testing.assert_close(out16.float(), out, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize(("seqlens", "s_q"), [([5, 13, 1], 1), ([7, 2, 16], 2), ([0, 9], 1)])
def test_mla_decode_absorbed_matches_the_folds_around_naive_attention(
    ops: Ops, seqlens: list[int], s_q: int
) -> None:
    """The absorbed path (torch: batched GEMMs around mla_decode; numba: one fused kernel) against
    the folds written out around float64 attention (free cache slots hold NaN: never read); a
    sequence's result does not depend on the rest of the batch; bf16 within its rounding."""
    gen = torch.Generator().manual_seed(sum(seqlens) + s_q)
    nope, v = 5, 7  # the latent is the first DV channels of D, the rest the rotated key
    k_cache, block_table, tokens = _paged_cache(seqlens, 4, gen)
    q_nope, q_pe = (
        torch.randn(len(seqlens), s_q, H, nope, generator=gen),
        torch.randn(len(seqlens), s_q, H, D - DV, generator=gen),
    )
    w_uk, w_uv_t = torch.randn(H, nope, DV, generator=gen), torch.randn(H, DV, v, generator=gen)
    lens = torch.tensor(seqlens, dtype=torch.int32)
    out = ops.mla_decode_absorbed(q_nope, q_pe, w_uk, w_uv_t, k_cache, block_table, lens, 0.3, True)
    assert out.shape == (len(seqlens), s_q, H, v) and out.dtype == torch.float32
    q = torch.cat([torch.einsum("bshd,hdc->bshc", q_nope.double(), w_uk.double()), q_pe.double()], dim=-1)
    latent, _ = _naive(q, tokens, 0.3, True)
    expected = torch.einsum("bshc,hcv->bshv", latent, w_uv_t.double())
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-4)
    as_the_model_keeps_it = w_uv_t.transpose(1, 2).contiguous().transpose(1, 2)  # prepare_absorbed
    viewed = ops.mla_decode_absorbed(q_nope, q_pe, w_uk, as_the_model_keeps_it, k_cache, block_table, lens, 0.3, True)  # fmt: skip
    torch.testing.assert_close(viewed, out, rtol=1e-6, atol=1e-6)
    if ops.backends["mla"] == "numba":  # the kernel reads that layout; any other is copied to it
        assert torch.equal(viewed, out)
    for b in range(len(seqlens)):
        alone = ops.mla_decode_absorbed(
            q_nope[b : b + 1],
            q_pe[b : b + 1],
            w_uk,
            w_uv_t,
            k_cache,
            block_table[b : b + 1],
            lens[b : b + 1],
            0.3,
            True,
        )
        if ops.backends["mla"] == "numba":  # one kernel, rows in whole blocks of four: the same bits
            assert torch.equal(alone[0], out[b])
        else:  # MKL's batched GEMMs may sum in another order for another batch
            torch.testing.assert_close(alone[0], out[b], rtol=1e-5, atol=1e-5)
    half = [t.bfloat16() for t in (q_nope, q_pe, w_uk, w_uv_t, k_cache)]
    out16 = ops.mla_decode_absorbed(*half[:4], half[4], block_table, lens, 0.3, True)
    assert out16.dtype == torch.bfloat16
    torch.testing.assert_close(out16.float(), out, rtol=5e-2, atol=0.3)


@pytest.mark.parametrize(("heads", "s_q"), [(3, 3), (4, 1), (16, 2), (5, 2)])
def test_absorbed_kernel_rows_split_over_tasks_give_the_same_bits(heads: int, s_q: int) -> None:
    """A sequence's query rows in one task or spread over several (whole blocks of four, the last
    one short): every output bit the same, dtype for dtype."""
    from dsinfer.ops import mla_cpu

    gen = torch.Generator().manual_seed(heads * 10 + s_q)
    seqlens = [11, 37]
    k_cache, block_table, _ = _paged_cache(seqlens, 8, gen)
    q_nope = torch.randn(2, s_q, heads, 6, generator=gen)
    q_pe = torch.randn(2, s_q, heads, D - DV, generator=gen)
    w_uk, w_uv_t = torch.randn(heads, 6, DV, generator=gen), torch.randn(heads, DV, 5, generator=gen)
    lens = torch.tensor(seqlens, dtype=torch.int32)
    for dtype in (torch.float32, torch.bfloat16):
        args = [t.to(dtype) for t in (q_nope, q_pe, w_uk, w_uv_t, k_cache)]
        outs = []
        for groups in (1, 2, 3, 8):
            outs.append(mla_cpu.mla_decode_absorbed_in_groups(*args, block_table, lens, 0.3, True, groups))
        assert all(torch.equal(out, outs[0]) for out in outs[1:])


def test_row_groups_fill_the_threads_in_whole_blocks() -> None:
    from dsinfer.ops.mla_cpu import row_groups

    assert row_groups(64, 4, 2) == 1  # the sequences fill the threads
    assert row_groups(1, 4, 2) == 1  # one block of rows
    assert row_groups(1, 12, 2) == 2 and row_groups(1, 128, 16) == 16
    assert row_groups(3, 128, 16) == 6


def test_flashmla_adapter_plumbing(ops: Ops) -> None:
    """UNVERIFIED adapter: check only how it calls both API generations (fake modules)."""
    calls: list[tuple] = []

    def make(generation: str) -> types.ModuleType:
        mod = types.ModuleType(f"fake_flash_mla_{generation}")

        def get_mla_metadata(*args):
            calls.append(("meta", generation, args[1:]))
            return "tile", ("splits" if generation == "old" else None)

        def flash_mla_with_kvcache(q, k, bt, lens, dv, md, ns, softmax_scale=None, causal=False):
            calls.append(("fwd", generation, md, ns, softmax_scale, causal))
            return ops.mla_decode(q, k, bt, lens, dv, softmax_scale, causal)

        mod.get_mla_metadata = get_mla_metadata
        mod.flash_mla_with_kvcache = flash_mla_with_kvcache
        if generation == "new":
            mod.FlashMLASchedMeta = object
        return mod

    gen = torch.Generator().manual_seed(13)
    k_cache, block_table, _ = _paged_cache([70, 5], 64, gen)
    q = torch.randn(2, 1, 4, D, generator=gen).bfloat16()
    lens = torch.tensor([70, 5], dtype=torch.int32)
    for generation in ("old", "new"):
        adapter = FlashMlaAdapter(make(generation))
        assert adapter.api == generation
        out, _ = adapter.mla_decode(q, k_cache.bfloat16(), block_table, lens, DV, 0.25, True)
        assert out.shape == (2, 1, 4, DV)
    assert calls[0] == ("meta", "old", (4, 1))  # s_q * h_q // h_kv, h_kv
    assert calls[1] == ("fwd", "old", "tile", "splits", 0.25, True)
    assert calls[2] == ("meta", "new", ())
    assert calls[3] == ("fwd", "new", "tile", None, 0.25, True)


def _counting_flash_mla(generation: str, calls: list[str], ops: Ops) -> types.ModuleType:
    """A stand-in FlashMLA whose metadata builds are counted; the newest generation keeps
    FlashMLASchedMeta in its interface submodule, as the package does."""
    mod = types.ModuleType(f"fake_flash_mla_{generation}")

    def get_mla_metadata(*args):
        calls.append("meta")
        return (object(), None) if generation == "new" else ("tile", "splits")

    def flash_mla_with_kvcache(q, k, bt, lens, dv, md, ns, softmax_scale=None, causal=False):
        calls.append("fwd")
        return ops.mla_decode(q, k, bt, lens, dv, softmax_scale, causal)

    mod.get_mla_metadata = get_mla_metadata
    mod.flash_mla_with_kvcache = flash_mla_with_kvcache
    if generation == "new":
        mod.flash_mla_interface = types.SimpleNamespace(FlashMLASchedMeta=object)
    return mod


@pytest.mark.parametrize("generation", ["old", "new"])
def test_flashmla_metadata_once_per_step(ops: Ops, generation: str) -> None:
    calls: list[str] = []
    adapter = FlashMlaAdapter(_counting_flash_mla(generation, calls, ops))
    assert adapter.api == generation and flash_mla_api(adapter._fm) == generation
    gen = torch.Generator().manual_seed(5)
    k_cache, block_table, _ = _paged_cache([70, 5], 64, gen)
    k_cache = k_cache.bfloat16()
    q = torch.randn(2, 1, 4, D, generator=gen).bfloat16()
    step = torch.tensor([70, 5], dtype=torch.int32)
    for _ in range(3):  # three layers of one step share its cache_seqlens tensor
        adapter.mla_decode(q, k_cache, block_table, step, DV, 0.25, True)
    assert adapter.metadata_builds == 1 and calls.count("fwd") == 3
    adapter.mla_decode(q[:, :, :2], k_cache, block_table, step, DV, 0.25, True)  # other heads
    next_step = torch.tensor([71, 6], dtype=torch.int32)
    adapter.mla_decode(q, k_cache, block_table, next_step, DV, 0.25, True)
    assert adapter.metadata_builds == 3


def test_flashmla_float32_goes_to_the_fallback(ops: Ops) -> None:
    """FlashMLA takes bf16/fp16 only; float32 goes to the fallback it was given (the Triton kernel
    on a GPU, whose decode has no host synchronisation), never to FlashMLA."""
    calls: list[str] = []
    used: list[torch.dtype] = []

    def fallback(q, *args):
        used.append(q.dtype)
        return ops.mla_decode(q, *args)

    adapter = FlashMlaAdapter(_counting_flash_mla("new", calls, ops), fallback=fallback)
    gen = torch.Generator().manual_seed(6)
    k_cache, block_table, _ = _paged_cache([9], 64, gen)
    q = torch.randn(1, 1, 4, D, generator=gen)
    lens = torch.tensor([9], dtype=torch.int32)
    out, _ = adapter.mla_decode(q, k_cache, block_table, lens, DV, 0.25, True)
    assert used == [torch.float32] and calls == [] and out.dtype == torch.float32


def test_external_backends_need_sm90() -> None:
    assert capability_unsupported("deepgemm", (9, 0)) is None
    assert capability_unsupported("flashmla", (9, 0)) is None
    assert "needs compute capability 9.0 (SM90), this GPU is 10.0" in str(
        capability_unsupported("deepgemm", (10, 0))
    )
    assert "this GPU is 8.9" in str(capability_unsupported("flashmla", (8, 9)))
