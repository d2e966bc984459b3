"""The FlashMLA / DeepGEMM adapters over stand-in modules of each library generation.

Each stand-in mimics one generation's names and signatures (read from the pinned sources: FlashMLA
1408756 = the V3.2 release generation and 9241ae3; DeepGEMM before and after its 2025-07 renaming,
594953a = the V3.2 release and 2.6.1 at 54e2261), asserts what the real kernels assert on their
arguments, computes with the torch references on the CPU, and records what it was given. The
adapters must detect the generation once, call it as it wants, and return what the references
return."""

from __future__ import annotations

import inspect
import math
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch

from dsinfer.ops import external, external_fp4, external_sparse, select_ops
from dsinfer.ops import gemm as torch_gemm
from dsinfer.ops import indexer as torch_indexer
from dsinfer.ops import mla as torch_mla
from dsinfer.ops import sparse_mla as torch_sparse_mla
from dsinfer.ops.external import DeepGemmAdapter, FlashMlaAdapter, flash_mla_api
from dsinfer.ops.external_sparse import DeepGemmIndexerAdapter, FlashMlaSparseAdapter
from dsinfer.ops.fp8 import FP8_DTYPE, fp8_gemm_nt, quantize_weight_128x128


class FakeFn:
    """A stand-in library function: runs ``impl``, records every call, and counts how often its
    signature is read (``inspect.signature`` reads ``__signature__``). ``hidden`` makes it read
    like a C extension's function, whose signature cannot be read."""

    def __init__(self, impl: Callable[..., Any], *, hidden: bool = False) -> None:
        self.impl = impl
        self.hidden = hidden
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        self.signature_reads = 0

    @property
    def __signature__(self) -> inspect.Signature:
        self.signature_reads += 1
        if self.hidden:
            raise ValueError("no signature found for builtin")
        return inspect.signature(self.impl)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append((args, kwargs))
        return self.impl(*args, **kwargs)


# ---------------------------------------------------------------------------------------- FlashMLA

SPARSE_D, SPARSE_DV = 576, 512
V4_D = 512  # DeepSeek-V4: 448 nope + 64 rope channels, keys and values


class SchedMeta:
    """FlashMLA 9241ae3's FlashMLASchedMeta: filled by the first call that uses it."""

    have_initialized = False


def _dense_reference(q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal):  # type: ignore[no-untyped-def]
    assert block_table.dtype == torch.int32 and cache_seqlens.dtype == torch.int32
    assert cache_seqlens.is_contiguous() and block_table.stride(-1) == 1 and k_cache.shape[1] == 64
    return torch_mla.mla_decode(q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal)


def _sparse_reference(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float, d_v: int):  # type: ignore[no-untyped-def]
    """What flash_mla_sparse_fwd asserts, and its results in natural log: (out, max_logits, lse)."""
    s_q, h_q, d = q.shape
    s_kv, topk = kv.shape[0], indices.shape[-1]
    assert q.dtype == kv.dtype == torch.bfloat16 and indices.dtype == torch.int32
    assert kv.shape == (s_kv, 1, d) and indices.shape == (s_q, 1, topk)
    assert d == SPARSE_D and d_v == SPARSE_DV and topk % 128 == 0 and h_q % 64 == 0
    assert q.stride(-1) == kv.stride(-1) == indices.stride(-1) == 1
    out, lse = torch_sparse_mla.sparse_mla_decode(
        q[None], kv.view(s_kv, 1, 1, d), indices.view(1, s_q, topk), d_v, sm_scale
    )
    return out[0], torch.zeros(s_q, h_q), lse[0].T.contiguous()


def _sparse_fwd_v32(q, kv, indices, sm_scale, d_v=512):  # type: ignore[no-untyped-def]
    """FlashMLA c28eca9 .. 1408756: "lse: 2-based log-sum-exp"; rows with no key left undefined."""
    out, max_logits, lse = _sparse_reference(q, kv, indices, sm_scale, d_v)
    lonely = (indices < 0).all(dim=-1)  # [s_q, 1]
    out = torch.where(lonely[..., None], float("nan"), out)
    lse = torch.where(lonely, -123.0, lse / math.log(2.0))
    return out, max_logits, lse


def _sparse_fwd_9241ae3(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None):  # type: ignore[no-untyped-def]
    """FlashMLA 082094b .. 9241ae3 as its docstring and tests/ref.py define it, in torch: d_qk 576
    (V3.2) or 512 ("MODEL1", DeepSeek-V4: K is V), exactly 64 or 128 heads, natural-log LSE
    without the sink, ``out`` scaled by ``1 / (1 + exp(sink - lse))``, indices -1 or >= s_kv (and
    past ``topk_length``) skipped, a row with none: ``out`` 0, ``lse`` +inf."""
    s_q, h_q, d_qk = q.shape
    s_kv, topk = kv.shape[0], indices.shape[-1]
    assert q.dtype == kv.dtype == torch.bfloat16 and indices.dtype == torch.int32
    assert d_qk in (SPARSE_D, V4_D) and d_v == SPARSE_DV and h_q in (64, 128) and topk % 128 == 0
    assert kv.shape == (s_kv, 1, d_qk) and indices.shape == (s_q, 1, topk)
    assert q.stride(-1) == kv.stride(-1) == indices.stride(-1) == 1
    idx = indices[:, 0].long()
    valid = (idx >= 0) & (idx < s_kv)
    if topk_length is not None:
        assert topk_length.dtype == torch.int32 and topk_length.shape == (s_q,)
        valid &= torch.arange(topk)[None, :] < topk_length[:, None]
    picked = kv[:, 0].float()[idx.clamp(0, s_kv - 1)]  # [s_q, topk, d_qk]
    scores = torch.einsum("shd,skd->shk", q.float(), picked) * sm_scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [s_q, h_q]
    out = torch.einsum("shk,skv->shv", torch.softmax(scores, dim=-1).nan_to_num(0.0), picked[..., :d_v])
    if attn_sink is not None:
        assert attn_sink.dtype == torch.float32 and attn_sink.shape == (h_q,)
        out = out / (1.0 + torch.exp(attn_sink[None, :] - lse))[..., None]
    lse = torch.where(torch.isneginf(lse), float("inf"), lse)
    return out.to(torch.bfloat16), scores.amax(dim=-1), lse


def _flash_mla(generation: str, *, hidden: bool = False) -> types.ModuleType:
    """``old`` (1408756), ``new`` (9241ae3) or ``legacy_flag`` (9241ae3 plus a ``use_legacy``
    parameter, as some builds have). ``hidden``: its functions' signatures cannot be read."""
    mod = types.ModuleType(f"fake_flash_mla_{generation}")
    if generation == "old":

        def get_mla_metadata(cache_seqlens, num_q_tokens_per_head_k, num_heads_k, num_heads_q=None, is_fp8_kvcache=False, topk=None):  # type: ignore[no-untyped-def]  # fmt: skip
            return ("tile", num_q_tokens_per_head_k, num_heads_k), "splits"

        def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits, softmax_scale=None, causal=False, is_fp8_kvcache=False, indices=None):  # type: ignore[no-untyped-def]  # fmt: skip
            assert tile_scheduler_metadata[0] == "tile" and num_splits == "splits"
            return _dense_reference(q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal)

        sparse: Callable[..., Any] = _sparse_fwd_v32
    else:

        def get_mla_metadata(*args, **kwargs):  # type: ignore[no-untyped-def]
            return SchedMeta(), None

        def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits=None, softmax_scale=None, causal=False, is_fp8_kvcache=False, indices=None, attn_sink=None, use_legacy=False):  # type: ignore[no-untyped-def]  # fmt: skip
            assert isinstance(tile_scheduler_metadata, SchedMeta) and num_splits is None
            return _dense_reference(q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal)

        if generation == "new":  # the same function without the flag
            params = [
                p
                for n, p in inspect.signature(flash_mla_with_kvcache).parameters.items()
                if n != "use_legacy"
            ]
            flash_mla_with_kvcache.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        mod.flash_mla_interface = types.SimpleNamespace(FlashMLASchedMeta=SchedMeta)
        sparse = _sparse_fwd_9241ae3
    mod.get_mla_metadata = FakeFn(get_mla_metadata, hidden=hidden)
    mod.flash_mla_with_kvcache = FakeFn(flash_mla_with_kvcache, hidden=hidden)
    mod.flash_mla_sparse_fwd = FakeFn(sparse, hidden=hidden)
    return mod


def _dense_inputs(gen: torch.Generator, seqlens: list[int], heads: int = 4, dim: int = 24):  # type: ignore[no-untyped-def]
    pages = [-(-n // 64) for n in seqlens]
    k_cache = torch.randn(sum(pages) + 1, 64, 1, dim, generator=gen).bfloat16()
    block_table = torch.zeros(len(seqlens), max(pages), dtype=torch.int32)
    order = torch.randperm(k_cache.shape[0], generator=gen).tolist()
    for b, count in enumerate(pages):
        block_table[b, :count] = torch.tensor([order.pop() for _ in range(count)])
    q = torch.randn(len(seqlens), 1, heads, dim, generator=gen).bfloat16()
    return q, k_cache, block_table, torch.tensor(seqlens, dtype=torch.int32)


@pytest.mark.parametrize(
    ("generation", "api", "use_legacy"),
    [("old", "old", False), ("new", "new", False), ("legacy_flag", "new", True)],
)
def test_flashmla_dense_detects_the_generation_and_use_legacy(
    generation: str, api: str, use_legacy: bool
) -> None:
    fm = _flash_mla(generation)
    adapter = FlashMlaAdapter(fm)
    assert (adapter.api, flash_mla_api(fm), adapter.passes_use_legacy) == (api, api, use_legacy)
    reads = fm.flash_mla_with_kvcache.signature_reads
    assert reads == 1  # probed once, at construction
    q, k_cache, block_table, lens = _dense_inputs(torch.Generator().manual_seed(1), [70, 5])
    for _ in range(3):
        out, lse = adapter.mla_decode(q, k_cache, block_table, lens, 16, 0.25, True)
    want_out, want_lse = torch_mla.mla_decode(q, k_cache, block_table, lens, 16, 0.25, True)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse.float())
    kwargs = [kw for _, kw in fm.flash_mla_with_kvcache.calls]
    assert len(kwargs) == 3 and all(kw.get("use_legacy") is (True if use_legacy else None) for kw in kwargs)
    assert fm.flash_mla_with_kvcache.signature_reads == reads  # never probed per call
    if api == "old":  # the metadata of the original API: s_q * h_q // h_kv, h_kv
        assert fm.get_mla_metadata.calls[0][0][1:] == (4, 1)


def test_flashmla_dense_without_a_readable_signature_passes_no_use_legacy() -> None:
    """A C extension's function has no signature: unknown, so use_legacy is not passed."""
    fm = _flash_mla("legacy_flag", hidden=True)
    adapter = FlashMlaAdapter(fm)
    assert adapter.api == "new" and not adapter.passes_use_legacy
    q, k_cache, block_table, lens = _dense_inputs(torch.Generator().manual_seed(2), [9])
    adapter.mla_decode(q, k_cache, block_table, lens, 16, 0.25, False)
    assert "use_legacy" not in fm.flash_mla_with_kvcache.calls[0][1]


def _sparse_inputs(gen: torch.Generator, bsz: int, s_q: int, heads: int, topk: int):  # type: ignore[no-untyped-def]
    """q bf16 [B, s_q, H, 576], k_cache bf16 [3, 64, 1, 576], indices [B, s_q, topk]: random slots,
    some -1, and the last row with none."""
    k_cache = torch.randn(3, 64, 1, SPARSE_D, generator=gen).bfloat16()
    q = torch.randn(bsz, s_q, heads, SPARSE_D, generator=gen).bfloat16()
    slots = k_cache.shape[0] * k_cache.shape[1]
    indices = torch.stack([torch.randperm(slots, generator=gen)[:topk] for _ in range(bsz * s_q)])
    indices = indices.view(bsz, s_q, topk).to(torch.int32)
    indices[0, 0, ::3] = -1
    indices[-1, -1] = -1
    return q, k_cache, indices


@pytest.mark.parametrize(
    ("generation", "base", "heads", "topk", "s_q"),
    [("old", "2", 16, 20, 1), ("new", "e", 16, 20, 2), ("new", "e", 128, 128, 1), ("old", "2", 65, 130, 1)],
)
def test_flashmla_sparse_reads_the_lse_base_and_matches_the_reference(
    generation: str, base: str, heads: int, topk: int, s_q: int
) -> None:
    fm = _flash_mla(generation)
    adapter = FlashMlaSparseAdapter(fm, require_cuda=False)
    assert (adapter.lse_base, adapter.lse_probe) == (base, "signature")
    q, k_cache, indices = _sparse_inputs(torch.Generator().manual_seed(heads + topk), 2, s_q, heads, topk)
    out, lse = adapter.sparse_mla_decode(q, k_cache, indices, SPARSE_DV, 0.05)
    want_out, want_lse = torch_sparse_mla.sparse_mla_decode(q, k_cache, indices, SPARSE_DV, 0.05)
    assert out.shape == want_out.shape and out.dtype == torch.bfloat16 and lse.shape == want_lse.shape
    torch.testing.assert_close(out, want_out, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)  # natural log, +inf on the empty row
    assert torch.isinf(lse[-1, :, -1]).all() and (out[-1, -1] == 0).all()
    (args, _), *_ = fm.flash_mla_sparse_fwd.calls
    assert args[0].shape[1] == (64 if heads <= 64 else 128) and args[2].shape[-1] % 128 == 0


@pytest.mark.parametrize(("generation", "base"), [("old", "2"), ("new", "e")])
def test_flashmla_sparse_measures_the_lse_base_once_when_the_signature_is_unknown(
    generation: str, base: str
) -> None:
    fm = _flash_mla(generation, hidden=True)
    adapter = FlashMlaSparseAdapter(fm, device=torch.device("cpu"), require_cuda=False)
    assert (adapter.lse_base, adapter.lse_probe) == (None, "pending")  # measured on a GPU only
    q, k_cache, indices = _sparse_inputs(torch.Generator().manual_seed(3), 2, 1, 16, 20)
    for _ in range(3):
        _, lse = adapter.sparse_mla_decode(q, k_cache, indices, SPARSE_DV, 0.05)
    assert (adapter.lse_base, adapter.lse_probe) == (base, "measured")
    assert len(fm.flash_mla_sparse_fwd.calls) == 4  # one probe, then the three calls
    _, want_lse = torch_sparse_mla.sparse_mla_decode(q, k_cache, indices, SPARSE_DV, 0.05)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)


def test_sparse_lse_base_markers() -> None:
    assert external_sparse.sparse_lse_base(_sparse_fwd_v32) == "2"
    assert external_sparse.sparse_lse_base(_sparse_fwd_9241ae3) == "e"
    assert external_sparse.sparse_lse_base(lambda *args, **kwargs: None) is None
    assert external_sparse.sparse_lse_base(FakeFn(_sparse_fwd_9241ae3, hidden=True)) is None
    with pytest.raises(RuntimeError, match="zero scores"):
        external_sparse.measure_lse_base(
            lambda *args: (None, None, torch.full((1, 64), 1.0)), torch.device("cpu")
        )


def _v4_rows(gen: torch.Generator, tokens: int, heads: int, keys: int, topk: int):  # type: ignore[no-untyped-def]
    """V4-shaped sparse MLA inputs: q bf16 [1, tokens, heads, 512], the K=V rows as a page-size-1
    cache [keys, 1, 1, 512] (as v4_attention._attend passes them), indices [1, tokens, topk] with
    some -1 and one row with none."""
    rows = torch.randn(keys, V4_D, generator=gen).bfloat16()
    q = torch.randn(1, tokens, heads, V4_D, generator=gen).bfloat16()
    indices = torch.stack([torch.randperm(keys, generator=gen)[:topk] for _ in range(tokens)])
    indices = indices.to(torch.int32).view(1, tokens, topk)
    indices[0, 0, 1::2] = -1
    indices[0, tokens // 2] = -1
    return q, rows.view(keys, 1, 1, V4_D), indices


@pytest.mark.parametrize(
    ("generation", "hidden", "native"), [("new", False, True), ("old", False, False), ("new", True, False)]
)
def test_flashmla_sparse_takes_v4_rows_only_where_the_signature_shows_model1(
    generation: str, hidden: bool, native: bool
) -> None:
    """d_qk 512 goes to the kernel of the 082094b generation (attn_sink/topk_length in its
    signature); the V3.2 generation has no such kernel and an unreadable signature proves nothing:
    both go to the reference."""
    fm = _flash_mla(generation, hidden=hidden)
    adapter = FlashMlaSparseAdapter(fm, require_cuda=False)
    assert adapter.head_dims == ((SPARSE_D, V4_D) if native else (SPARSE_D,))
    q, k_cache, indices = _v4_rows(torch.Generator().manual_seed(12), 5, 8, 40, 20)
    out, lse = adapter.sparse_mla_decode(q, k_cache, indices, V4_D, V4_D**-0.5)
    want_out, want_lse = torch_sparse_mla.sparse_mla_decode(q, k_cache, indices, V4_D, V4_D**-0.5)
    assert out.shape == want_out.shape and out.dtype == torch.bfloat16
    torch.testing.assert_close(out, want_out, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
    assert torch.isinf(lse[0, :, 2]).all() and (out[0, 2] == 0).all()  # the row with no index
    calls = fm.flash_mla_sparse_fwd.calls
    if not native:
        assert calls == []
        return
    (args, kwargs), *rest = calls
    assert rest == [] and kwargs == {}
    assert args[0].shape == (5, 64, V4_D) and args[1].shape == (40, 1, V4_D) and args[4] == V4_D
    assert args[2].shape == (5, 1, 128) and (args[2][:, :, 20:] == -1).all()  # padded with -1


def test_v4_sink_applied_from_the_lse_equals_the_kernels_attn_sink() -> None:
    """v4_attention._attend scales the adapter's output by 1 / (1 + exp(sink - lse)); FlashMLA's
    attn_sink does the same inside and leaves the LSE without the sink: both equal a softmax with
    the sink logit in its denominator."""
    from dsinfer.model.v4_attention import V4Attention

    fm = _flash_mla("new")
    adapter = FlashMlaSparseAdapter(fm, require_cuda=False)
    gen = torch.Generator().manual_seed(13)
    heads, tokens, keys = 64, 4, 30
    q = torch.randn(tokens, heads, V4_D, generator=gen).bfloat16()
    rows = torch.randn(keys, V4_D, generator=gen).bfloat16()
    mask = torch.rand(tokens, keys, generator=gen) < 0.5
    mask[:, 0] = True
    sink = torch.randn(heads, generator=gen)
    attention = types.SimpleNamespace(
        ops=types.SimpleNamespace(sparse_mla_decode=adapter.sparse_mla_decode),
        attn_sink=sink,
        head_dim=V4_D,
    )
    got = V4Attention._attend(attention, q, rows, mask)  # type: ignore[arg-type]
    assert len(fm.flash_mla_sparse_fwd.calls) == 1
    scores = torch.einsum("thd,kd->thk", q.float(), rows.float()) * V4_D**-0.5
    scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    weights = scores.exp() / (scores.exp().sum(-1, keepdim=True) + sink.exp()[None, :, None])
    want = torch.einsum("thk,kd->thd", weights, rows.float())
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
    indices = torch.where(mask, torch.arange(keys), -1).to(torch.int32)
    indices = torch.nn.functional.pad(indices, (0, 128 - keys), value=-1).view(tokens, 1, 128)
    inside, _, lse = _sparse_fwd_9241ae3(q, rows.view(keys, 1, V4_D), indices, V4_D**-0.5, attn_sink=sink)
    torch.testing.assert_close(inside.float(), want, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse, torch.logsumexp(scores, dim=-1))  # the sink is not in the LSE


def test_flashmla_sparse_keeps_cpu_tensors_off_the_kernel_by_default() -> None:
    fm = _flash_mla("new")
    q, k_cache, indices = _sparse_inputs(torch.Generator().manual_seed(4), 1, 1, 16, 20)
    FlashMlaSparseAdapter(fm).sparse_mla_decode(q, k_cache, indices, SPARSE_DV, 0.05)
    FlashMlaSparseAdapter(fm, require_cuda=False).sparse_mla_decode(q, k_cache, indices, 64, 0.05)  # dv
    assert fm.flash_mla_sparse_fwd.calls == []


# ------------------------------------------------------------------------------------ DeepGEMM GEMM

GEMM_NAMES = {
    "fp8_fp4": (
        "fp8_fp4_gemm_nt",
        "m_grouped_fp8_fp4_gemm_nt_contiguous",
        "m_grouped_fp8_fp4_gemm_nt_masked",
    ),
    "new": ("fp8_gemm_nt", "m_grouped_fp8_gemm_nt_contiguous", "m_grouped_fp8_gemm_nt_masked"),
    "mid": ("fp8_gemm_nt", "m_grouped_fp8_gemm_nt_contiguous", "fp8_m_grouped_gemm_nt_masked"),
    "old": (
        "gemm_fp8_fp8_bf16_nt",
        "m_grouped_gemm_fp8_fp8_bf16_nt_contiguous",
        "m_grouped_gemm_fp8_fp8_bf16_nt_masked",
    ),
}


def _mn_major(sf: torch.Tensor) -> torch.Tensor:
    return sf.transpose(-1, -2).contiguous().transpose(-1, -2)


def _check_pair(pair: tuple[torch.Tensor, torch.Tensor], sfa: bool) -> None:
    values, sf = pair
    assert values.dtype == FP8_DTYPE and values.stride(-1) == 1 and sf.dtype == torch.float32
    if sfa and sf.shape[-2] > 1:
        assert sf.stride(-2) == 1, "activation scales must come MN-major (the layout helper ran)"


def _deep_gemm(generation: str, alignment: int = 128) -> types.ModuleType:
    """A stand-in DeepGEMM of one naming generation, asserting what 2.6.1's csrc/apis/gemm.hpp does."""
    mod = types.ModuleType(f"fake_deep_gemm_{generation}")

    def dense(a, b, d, c=None):  # type: ignore[no-untyped-def]
        _check_pair(a, True)
        _check_pair(b, False)
        assert d.dtype == torch.bfloat16 and c is None
        fp8_gemm_nt(a[0], a[1], b[0], b[1], d)

    def contiguous(a, b, d, grouped_layout):  # type: ignore[no-untyped-def]
        _check_pair(a, True)
        _check_pair(b, False)
        assert grouped_layout.dtype == torch.int32 and grouped_layout.is_contiguous()
        assert grouped_layout.shape == (a[0].shape[0],) and d.dtype == torch.bfloat16
        for g in range(b[0].shape[0]):
            rows = (grouped_layout == g).nonzero().squeeze(1)
            if len(rows):
                assert int(rows[0]) % alignment == 0 and len(rows) == int(rows[-1]) - int(rows[0]) + 1
                tmp = torch.empty(len(rows), d.shape[1])
                fp8_gemm_nt(a[0][rows], a[1][rows], b[0][g], b[1][g], tmp)
                d[rows] = tmp.to(d.dtype)

    def masked(a, b, d, masked_m, expected_m):  # type: ignore[no-untyped-def]
        _check_pair(a, True)
        _check_pair(b, False)
        assert masked_m.dtype == torch.int32 and masked_m.is_contiguous() and expected_m > 0
        assert a[0].shape[1] % alignment == 0
        for g in range(b[0].shape[0]):
            fp8_gemm_nt(a[0][g], a[1][g], b[0][g], b[1][g], d[g])

    for name, fn in zip(GEMM_NAMES[generation], (dense, contiguous, masked), strict=True):
        setattr(mod, name, FakeFn(fn))
    if generation == "fp8_fp4":  # 2.6.1 keeps the fp8_* names as aliases
        for alias, name in zip(GEMM_NAMES["new"], GEMM_NAMES["fp8_fp4"], strict=True):
            setattr(mod, alias, getattr(mod, name))
    helper = "get_col_major_tma_aligned_tensor" if generation == "old" else "get_mn_major_tma_aligned_tensor"
    setattr(mod, helper, FakeFn(_mn_major))
    align = (
        "get_m_alignment_for_contiguous_layout"
        if generation == "old"
        else "get_mk_alignment_for_contiguous_layout"
    )
    setattr(mod, align, lambda: alignment)
    return mod


@pytest.mark.parametrize(
    ("generation", "api"), [("fp8_fp4", "fp8_fp4"), ("new", "new"), ("mid", "new"), ("old", "old")]
)
def test_deepgemm_gemms_on_every_generation(generation: str, api: str) -> None:
    dg = _deep_gemm(generation, alignment=64)
    adapter = DeepGemmAdapter(dg)
    assert (adapter.api, adapter.m_alignment) == (api, 64)
    gen = torch.Generator().manual_seed(5)
    w, w_s = quantize_weight_128x128(torch.randn(64, 256, generator=gen))
    x = torch.randn(2, 3, 256, generator=gen)
    torch.testing.assert_close(adapter.linear(x, w, w_s), torch_gemm.linear(x, w, w_s), rtol=1e-2, atol=1e-2)
    pairs = [quantize_weight_128x128(torch.randn(64, 256, generator=gen)) for _ in range(3)]
    b, b_s = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
    m_indices = torch.tensor([2, 0, -1, 2, 0, 1, 0], dtype=torch.int32)
    a = torch.randn(7, 256, generator=gen)
    got = adapter.grouped_gemm_contiguous(a, b, b_s, m_indices)
    want = torch_gemm.grouped_gemm_contiguous(a, b, b_s, m_indices)
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    am = torch.randn(3, 5, 256, generator=gen)
    counts = torch.tensor([5, 0, 3], dtype=torch.int64)
    got = adapter.grouped_gemm_masked(am, b, b_s, counts, 0)
    want = torch_gemm.grouped_gemm_masked(am, b, b_s, counts, 0)
    for g, count in enumerate(counts.tolist()):
        torch.testing.assert_close(got[g, :count], want[g, :count], rtol=1e-2, atol=1e-2)
    helper = "get_col_major_tma_aligned_tensor" if generation == "old" else "get_mn_major_tma_aligned_tensor"
    assert len(getattr(dg, helper).calls) == 3


def test_deepgemm_exports_no_generation() -> None:
    partial = _deep_gemm("mid")
    del partial.fp8_m_grouped_gemm_nt_masked
    with pytest.raises(ImportError, match="no DeepGEMM API generation"):
        DeepGemmAdapter(partial)


# --------------------------------------------------------------------------------- DeepGEMM indexer

IX_DIM, IX_PAGE = 128, 64


def _paged_logits_reference(q, kv_cache, weights, lens_per_row, block_table, max_context_len, clean):  # type: ignore[no-untyped-def]
    """Logits of ``next_n = 1`` rows, keys ``< lens_per_row[r]`` visible; garbage (NaN) past
    them unless ``clean``. Returned as the kernel does: a slice of a wider, aligned buffer."""
    rows, next_n, heads, dim = q.shape
    blocks, block_kv, kv_heads, width = kv_cache.shape
    assert next_n in (1, 2) and q.dtype == FP8_DTYPE and q.is_contiguous()
    assert kv_cache.dtype == torch.uint8 and block_kv == IX_PAGE and kv_heads == 1 and width == dim + 4
    assert kv_cache.stride(1) == width and kv_cache.stride(2) == width and kv_cache.stride(3) == 1
    assert (
        weights.dtype == torch.float32 and weights.shape == (rows * next_n, heads) and weights.is_contiguous()
    )
    assert block_table.dtype == torch.int32 and block_table.shape[0] == rows and block_table.stride(1) == 1
    assert next_n == 1, "the adapter sends every query as a row of its own"
    logits = torch_indexer.indexer_logits(
        q, weights.view(rows, 1, heads), kv_cache.view(blocks, block_kv, width), block_table, lens_per_row
    ).view(rows, -1)[:, :max_context_len]
    if not clean:
        logits = torch.where(torch.isinf(logits), float("nan"), logits)
    buffer = torch.full((rows, max_context_len + 64), float("nan"))
    buffer[:, :max_context_len] = logits
    return buffer[:, :max_context_len]


def _deep_gemm_indexer(generation: str) -> types.ModuleType:
    """``fp8``: DeepGEMM 594953a (the V3.2 release; 1-D context lengths); ``fp8_fp4``: 2.6.1
    (``fp8_fp4_paged_mqa_logits`` plus the legacy name; 2-D context lengths only, and no
    clean_logits with them)."""
    mod = types.ModuleType(f"fake_deep_gemm_indexer_{generation}")
    ndim = 2 if generation == "fp8_fp4" else 1
    num_sms = 4

    def check_lens(context_lens: torch.Tensor) -> torch.Tensor:
        assert (
            context_lens.dim() == ndim and context_lens.dtype == torch.int32 and context_lens.is_contiguous()
        )
        return context_lens.reshape(-1)

    def metadata(context_lens, block_kv, num_sms_, indices=None):  # type: ignore[no-untyped-def]
        check_lens(context_lens)
        assert block_kv == IX_PAGE and num_sms_ == num_sms and indices is None
        return torch.zeros(num_sms + 1, 2, dtype=torch.int32)

    def fp8_paged(
        q, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len, clean_logits=False
    ):  # type: ignore[no-untyped-def]
        assert schedule_meta.shape == (num_sms + 1, 2) and not (clean_logits and ndim == 2)
        lens = check_lens(context_lens)
        return _paged_logits_reference(q, kv_cache, weights, lens, block_table, max_context_len, clean_logits)

    def fp8_fp4_paged(
        q,
        kv_cache,
        weights,
        context_lens,
        block_table,
        schedule_meta,
        max_context_len,
        clean_logits=False,
        logits_dtype=torch.float32,
        indices=None,
    ):  # type: ignore[no-untyped-def]
        q_fp, q_sf = q
        assert q_sf is None and logits_dtype == torch.float32 and indices is None
        return fp8_paged(
            q_fp, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len, clean_logits
        )

    mod.get_paged_mqa_logits_metadata = FakeFn(metadata)
    mod.fp8_paged_mqa_logits = FakeFn(fp8_paged)
    if generation == "fp8_fp4":
        mod.fp8_fp4_paged_mqa_logits = FakeFn(fp8_fp4_paged)
    mod.get_num_sms = lambda: num_sms
    return mod


def _indexer_inputs(gen: torch.Generator, seqlens: list[int], s_q: int, heads: int):  # type: ignore[no-untyped-def]
    pages = [-(-n // IX_PAGE) for n in seqlens]
    num_pages = sum(pages) + 1
    cache = torch.zeros(num_pages, IX_PAGE, IX_DIM + 4, dtype=torch.uint8)
    slots = torch.arange(num_pages * IX_PAGE)
    torch_indexer.write_keys(cache, slots, torch.randn(len(slots), IX_DIM, generator=gen))
    table = torch.zeros(len(seqlens), max(pages) + 1, dtype=torch.int32)
    order = torch.randperm(num_pages, generator=gen).tolist()
    for b, count in enumerate(pages):
        table[b, :count] = torch.tensor([order.pop() for _ in range(count)])
    q = torch.randn(len(seqlens), s_q, heads, IX_DIM, generator=gen).to(FP8_DTYPE)
    weights = torch.randn(len(seqlens), s_q, heads, generator=gen)
    return q, weights, cache, table, torch.tensor(seqlens, dtype=torch.int32)


@pytest.mark.parametrize(("generation", "s_q"), [("fp8", 1), ("fp8", 3), ("fp8_fp4", 1), ("fp8_fp4", 2)])
def test_deepgemm_indexer_on_each_generation(generation: str, s_q: int) -> None:
    dg = _deep_gemm_indexer(generation)
    adapter = DeepGemmIndexerAdapter(dg, require_cuda=False)
    assert (adapter.api, adapter.context_lens_2d) == (generation, generation == "fp8_fp4")
    q, weights, cache, table, lens = _indexer_inputs(torch.Generator().manual_seed(s_q), [30, 130], s_q, 32)
    got = adapter.indexer_topk(q, weights, cache, table, lens, 50)
    want = torch_indexer.indexer_topk(q, weights, cache, table, lens, 50)
    assert torch.equal(got, want)
    kernel = dg.fp8_fp4_paged_mqa_logits if generation == "fp8_fp4" else dg.fp8_paged_mqa_logits
    assert len(kernel.calls) == 1 and len(dg.get_paged_mqa_logits_metadata.calls) == 1
    if generation == "fp8_fp4":  # 2.6.1's own name, not the legacy wrapper
        assert dg.fp8_paged_mqa_logits.calls == []


def test_deepgemm_indexer_sends_what_the_kernel_cannot_take_to_the_reference() -> None:
    dg = _deep_gemm_indexer("fp8_fp4")
    gen = torch.Generator().manual_seed(9)
    q, weights, cache, table, lens = _indexer_inputs(gen, [70], 1, 16)  # 16 heads: not on SM90
    want = torch_indexer.indexer_topk(q, weights, cache, table, lens, 8)
    assert torch.equal(
        DeepGemmIndexerAdapter(dg, require_cuda=False).indexer_topk(q, weights, cache, table, lens, 8), want
    )
    q, weights, cache, table, lens = _indexer_inputs(gen, [70], 1, 64)
    DeepGemmIndexerAdapter(dg).indexer_topk(q, weights, cache, table, lens, 8)  # CPU tensors by default
    assert dg.fp8_fp4_paged_mqa_logits.calls == []
    with pytest.raises(ImportError):
        DeepGemmIndexerAdapter(types.ModuleType("empty"))


def test_query_context_lens_are_bottom_right_causal() -> None:
    lens = external_sparse.query_context_lens(torch.tensor([5, 1], dtype=torch.int32), 3)
    assert lens.tolist() == [3, 4, 5, 0, 0, 1] and lens.dtype == torch.int32


# ---------------------------------------------------------------------------------------- selection


def test_select_ops_on_cpu_never_builds_the_external_adapters(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[str] = []

    def refuse(name: str) -> Callable[..., Any]:
        def build(*args: Any, **kwargs: Any) -> Any:
            built.append(name)
            raise AssertionError(f"{name} built on the CPU")

        return build

    for module, name in (
        (external, "DeepGemmAdapter"),
        (external, "FlashMlaAdapter"),
        (external, "triton_gemm_adapter"),
        (external_sparse, "DeepGemmIndexerAdapter"),
        (external_sparse, "FlashMlaSparseAdapter"),
        (external_fp4, "DeepGemmMxfp4Adapter"),
    ):
        monkeypatch.setattr(module, name, refuse(name))
    for prefer in (None, "deepgemm,flashmla"):
        ops = select_ops("cpu", prefer=prefer)
        assert "deepgemm" not in ops.backends.values() and "flashmla" not in ops.backends.values()
    assert built == []
