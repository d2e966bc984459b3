"""V3.2's sparse-attention ops: the indexer's logits and top-k, its FP8 key cache, and sparse MLA
decode, each against a plain per-query loop written from the semantics (dsinfer/ops/indexer.py,
dsinfer/ops/sparse_mla.py), plus the dense MLA decode it must equal when every visible key is picked."""

from __future__ import annotations

import pytest
import torch

from dsinfer.ops import indexer as ix
from dsinfer.ops import select_ops
from dsinfer.ops.mla import mla_decode
from dsinfer.ops.sparse_mla import sparse_mla_decode

PS = 8


def paged_cache(
    lens: list[int], dim: int, gen: torch.Generator, dtype: torch.dtype = torch.float32, extra_pages: int = 3
) -> tuple[torch.Tensor, ...]:
    """(cache [P, PS, dim] with NaN in every unused slot, table int32 [B, W] padded with 0, lens):
    each sequence's tokens on shuffled pages."""
    pages_per_seq = [-(-n // PS) for n in lens]
    num_pages = sum(pages_per_seq) + extra_pages
    perm = torch.randperm(num_pages, generator=gen).tolist()
    cache = torch.full((num_pages, PS, dim), float("nan"))
    table = torch.zeros(len(lens), max(pages_per_seq) + 1, dtype=torch.int32)
    for b, n in enumerate(lens):
        for p in range(pages_per_seq[b]):
            page = perm.pop()
            table[b, p] = page
            count = min(PS, n - p * PS)
            cache[page, :count] = torch.randn(count, dim, generator=gen)
    return cache.to(dtype), table, torch.tensor(lens, dtype=torch.int32)


def _naive_logits(q, weights, cache, table, lens, b, j) -> dict[int, float]:  # type: ignore[no-untyped-def]
    """position -> logit for query j of sequence b, one key at a time."""
    s_q = q.shape[1]
    out = {}
    for t in range(int(lens[b]) - s_q + j + 1):
        key = cache[int(table[b, t // PS]), t % PS]
        out[t] = sum(float(weights[b, j, h]) * max(float(q[b, j, h] @ key), 0.0) for h in range(q.shape[2]))
    return out


def test_indexer_logits_and_topk_follow_the_definition() -> None:
    gen = torch.Generator().manual_seed(1)
    lens, s_q, heads, dim, topk = [3, 21, 40, 9], 2, 4, 16, 6
    cache, table, seqlens = paged_cache(lens, dim, gen)
    q = torch.randn(len(lens), s_q, heads, dim, generator=gen)
    weights = torch.randn(len(lens), s_q, heads, generator=gen)
    logits = ix.indexer_logits(q, weights, cache, table, seqlens)
    positions = ix.indexer_topk(q, weights, cache, table, seqlens, topk)
    assert logits.shape == (len(lens), s_q, table.shape[1] * PS) and positions.shape == (len(lens), s_q, topk)
    assert positions.dtype == torch.int32
    for b in range(len(lens)):
        for j in range(s_q):
            naive = _naive_logits(q, weights, cache, table, seqlens, b, j)
            row = logits[b, j]
            assert torch.isneginf(row[len(naive) :]).all()  # invisible keys (incl. NaN slots) never score
            torch.testing.assert_close(
                row[: len(naive)], torch.tensor(list(naive.values())), rtol=1e-5, atol=1e-5
            )
            best = sorted(naive, key=naive.__getitem__, reverse=True)[:topk]
            got = positions[b, j].tolist()
            assert got[: len(best)] == best and got[len(best) :] == [-1] * (topk - len(best))
    # asked for more keys than the block table has slots: as many as it has
    assert ix.indexer_topk(q, weights, cache, table, seqlens, 1000).shape[-1] == table.shape[1] * PS


def test_positions_to_slots_keeps_unused() -> None:
    table = torch.tensor([[4, 1, 7], [2, 0, 0]], dtype=torch.int32)
    positions = torch.tensor([[[0, 9, 17, -1]], [[3, -1, -1, 7]]], dtype=torch.int32)
    slots = ix.positions_to_slots(positions, table, PS)
    assert slots.tolist() == [[[32, 9, 57, -1]], [[19, -1, -1, 23]]]


def test_hadamard_is_orthonormal() -> None:
    x = torch.randn(5, 3, 64, generator=torch.Generator().manual_seed(2))
    y = ix.hadamard(x)
    torch.testing.assert_close(y @ y.transpose(-1, -2), x @ x.transpose(-1, -2), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(ix.hadamard(y), x, rtol=1e-5, atol=1e-5)  # its own inverse
    with pytest.raises(ValueError, match="power-of-two"):
        ix.hadamard(torch.zeros(2, 24))


def test_fp8_key_cache_layout_and_scores() -> None:
    """Keys written to an FP8 cache sit in DeepGEMM's page layout (e4m3 keys, then fp32 scales) and
    score within FP8 error of the plain keys; the top-k mostly agrees."""
    gen = torch.Generator().manual_seed(3)
    pages, dim = 6, 32
    keys = torch.randn(pages * PS, dim, generator=gen)
    fp8 = torch.zeros(pages, PS, dim + ix.SCALE_BYTES, dtype=torch.uint8)
    slots = torch.randperm(pages * PS, generator=gen)
    ix.write_keys(fp8, slots, keys[slots])
    flat = fp8.view(pages, PS * (dim + ix.SCALE_BYTES))
    scale = flat[:, PS * dim :].view(torch.float32)  # [pages, PS]
    assert torch.allclose(scale.flatten(), keys.abs().amax(-1) / 448.0)
    values = flat[:, : PS * dim].view(torch.float8_e4m3fn).reshape(pages * PS, dim)
    torch.testing.assert_close(values.float() * scale.reshape(-1, 1), keys, rtol=0.07, atol=0.0)
    torch.testing.assert_close(
        ix.dequantize_key_cache(fp8).view(-1, dim), values.float() * scale.reshape(-1, 1)
    )

    plain = keys.view(pages, PS, dim)
    table = torch.arange(pages, dtype=torch.int32).view(1, pages)
    lens = torch.tensor([pages * PS], dtype=torch.int32)
    q = torch.randn(1, 4, 8, dim, generator=gen)
    weights = torch.rand(1, 4, 8, generator=gen)
    exact = ix.indexer_logits(q, weights, plain, table, lens)
    q8, q_scale = ix.quantize_per_row(ix.hadamard(q))
    rotated = torch.zeros_like(fp8)
    ix.write_keys(rotated, torch.arange(pages * PS), ix.hadamard(keys))
    approx = ix.indexer_logits(q8, weights * q_scale, rotated, table, lens)
    visible = torch.isfinite(exact)
    assert torch.equal(visible, torch.isfinite(approx))
    error = (approx - exact)[visible].abs().max() / exact[visible].abs().max()
    assert error < 0.05, error
    picked = ix.select_topk(exact, 16)
    picked8 = ix.select_topk(approx, 16)
    overlap = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(picked[0], picked8[0], strict=True))
    assert overlap >= 0.8 * picked[0].numel(), overlap


def _naive_sparse(q, cache, indices, dv, scale) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[no-untyped-def]
    bsz, s_q, heads, dim = q.shape
    flat = cache.view(-1, dim)
    out = torch.zeros(bsz, s_q, heads, dv)
    lse = torch.full((bsz, heads, s_q), float("inf"))
    for b in range(bsz):
        for j in range(s_q):
            slots = [int(s) for s in indices[b, j] if s >= 0]
            if not slots:
                continue
            keys = flat[slots]
            scores = q[b, j] @ keys.T * scale  # [heads, k]
            out[b, j] = torch.softmax(scores, -1) @ keys[:, :dv]
            lse[b, :, j] = torch.logsumexp(scores, -1)
    return out, lse


def test_sparse_mla_decode_follows_the_definition() -> None:
    gen = torch.Generator().manual_seed(4)
    cache = torch.randn(10, PS, 1, 24, generator=gen)
    cache[3] = float("nan")  # never picked: must not leak
    q = torch.randn(3, 2, 5, 24, generator=gen)
    choices = [s for s in range(10 * PS) if s // PS != 3]
    indices = torch.tensor(choices)[torch.randint(0, len(choices), (3, 2, 7), generator=gen)].to(torch.int32)
    indices[0, 1, 2:] = -1
    indices[2, 0] = -1  # a query with nothing to attend to
    out, lse = sparse_mla_decode(q, cache, indices, 16, 0.3)
    ref_out, ref_lse = _naive_sparse(q, cache, indices, 16, 0.3)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[2, 0], torch.zeros(5, 16)) and torch.isposinf(lse[2, :, 0]).all()


def test_sparse_decode_over_every_visible_key_equals_dense_decode() -> None:
    """Picking every key a query sees (bottom-right causal) gives the dense paged decode."""
    gen = torch.Generator().manual_seed(5)
    lens, s_q = [5, 30, 17], 2
    cache, table, seqlens = paged_cache(lens, 40, gen)
    q = torch.randn(len(lens), s_q, 4, 40, generator=gen)
    length = table.shape[1] * PS
    visible = ix.visible_keys(seqlens, s_q, length)
    positions = torch.where(visible, torch.arange(length), -1).to(torch.int32)
    slots = ix.positions_to_slots(positions, table, PS)
    sparse_out, sparse_lse = sparse_mla_decode(q, cache.unsqueeze(2), slots, 32, 0.25)
    dense_out, dense_lse = mla_decode(q, cache.unsqueeze(2), table, seqlens, 32, 0.25, causal=True)
    torch.testing.assert_close(sparse_out, dense_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sparse_lse, dense_lse, rtol=1e-5, atol=1e-5)


def test_backends_are_listed_and_chosen_on_cpu() -> None:
    ops = select_ops("cpu")
    assert ops.backends["indexer"] == "torch" and ops.backends["sparse_mla"] == "torch"
    assert ops.sparse_mla_decode is sparse_mla_decode
