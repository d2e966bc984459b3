"""Adapters from V3.2's sparse-attention entry points to DeepGEMM and FlashMLA.

UNVERIFIED on hardware: neither library can be installed on the machines this project is developed
on. The calls follow the sources of the pinned releases (DeepGEMM 2.6.1 at 54e2261, FlashMLA
9241ae3) and of the V3.2 release generation (DeepGEMM 594953a, FlashMLA c28eca9). What differs
between generations is probed once, when an adapter is built (``select_ops`` builds them once, at
backend selection, and only when the import succeeds on an SM90 device), and recorded on it. What
the kernels cannot express goes to the torch reference, whose semantics they share.

- ``DeepGemmIndexerAdapter.indexer_topk``: DeepGEMM's paged MQA logits over the FP8 key cache
  (uint8 ``[blocks, 64, D + 4]``, DeepGEMM's fused layout, which is the pool's FP8 indexer format)
  with an e4m3 query whose scales are folded into ``weights``; then the shared top-k. Every query
  row goes to the kernel as a sequence of its own (``next_n = 1``, its own context length and a
  copy of its block-table row), which every generation takes whatever ``s_q`` is; the keys a query
  does not see are masked here, so no generation's ``clean_logits`` is needed (2.6.1 refuses it
  with per-query context lengths). A plain key cache or query goes to the reference.
- ``FlashMlaSparseAdapter.sparse_mla_decode``: ``flash_mla_sparse_fwd`` (token-level sparse MQA,
  bf16 KV, FlashMLA's "sparse prefill" kernel, which takes any number of query rows) over the bf16
  latent cache viewed as one flat ``[slots, 1, 576]`` tensor, so the indices are the cache slots
  themselves. FlashMLA's sparse *decode* kernel (``flash_mla_with_kvcache(..., is_fp8_kvcache=True,
  indices=...)``) needs the latent in its 656-byte FP8 format, which the pool does not keep yet.
  DeepSeek-V4's attention core (``v4_attention._attend``: 512-wide rows that are keys and values,
  448 nope + 64 rope channels) goes the same way, ``[rows, 1, 512]``, where the installed kernel
  has FlashMLA's "MODEL1" shape (d_qk 512, since 082094b; :func:`sparse_head_dims`). The caller
  applies V4's attention sink from the returned LSE, which is what the kernel's ``attn_sink`` does
  (out scaled by ``1 / (1 + exp(sink - lse))``, the LSE left without the sink), so the ``Ops``
  contract stays the one of every other backend. V4's sparse decode kernel
  (``flash_mla_with_kvcache(..., is_fp8_kvcache=True, indices=..., attn_sink=..., extra_k_cache=...,
  extra_indices_in_kvcache=..., topk_length=..., extra_topk_length=...)``) needs its own 584-byte
  FP8 rows (448 e4m3 nope values, 64 bf16 rope values, 7 UE8M0 scales and a pad byte), which the
  V4 pool does not keep either (it keeps rows in the model's dtype).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from dsinfer.ops import indexer as torch_indexer
from dsinfer.ops import sparse_mla as torch_sparse_mla
from dsinfer.ops.external import declared_parameters
from dsinfer.ops.fp8 import FP8_DTYPE

__all__ = ["DeepGemmIndexerAdapter", "FlashMlaSparseAdapter", "sparse_head_dims", "sparse_lse_base"]

INDEXER_PAGE_SIZE = 64  # SM90 paged MQA logits: block_kv == 64 in every generation
INDEXER_HEADS = (32, 64)  # 2.6.1 on SM90 asserts 32 or 64 heads (the V3.2 release was tested at 64)
INDEXER_HEAD_DIM = 128  # V3.2's index head dim: the one every generation's SM90 tests run
SPARSE_HEADS = (64, 128)  # flash_mla_sparse_fwd at 9241ae3 takes exactly 64 or 128 query heads
SPARSE_TOPK_MULTIPLE = 128  # SM90 sparse prefill: topk % (2 * B_TOPK) == 0 with B_TOPK = 64
SPARSE_HEAD_DIM, SPARSE_HEAD_DIM_V = 576, 512  # the dims every generation of the kernel takes
V4_HEAD_DIM = 512  # FlashMLA's "MODEL1" (DeepSeek-V4): K is V, d_qk == d_v, since 082094b
LSE_PROBE_KEYS = 128


class DeepGemmIndexerAdapter:
    """UNVERIFIED. V3.2's indexer logits through DeepGEMM's paged MQA logits kernel.

    ``api`` (probed once, here): "fp8_fp4" when the module exports ``fp8_fp4_paged_mqa_logits``
    (DeepGEMM 7f2a703, 2026-04-17, and 2.6.1): that commit also made the context lengths 2-D
    (``[batch, next_n]``) in both the metadata and the logits call. "fp8" before it (the V3.2
    release 594953a takes 1-D ``[batch]`` lengths only). ``context_lens_2d`` records the choice.
    ``require_cuda=False`` lets the tests run a stand-in module on the CPU.
    """

    def __init__(self, module: ModuleType, *, require_cuda: bool = True) -> None:
        if not hasattr(module, "get_paged_mqa_logits_metadata"):
            raise ImportError("deep_gemm lacks get_paged_mqa_logits_metadata (the V3.2 indexer kernels)")
        if hasattr(module, "fp8_fp4_paged_mqa_logits"):
            self.api = "fp8_fp4"
        elif hasattr(module, "fp8_paged_mqa_logits"):
            self.api = "fp8"
        else:
            raise ImportError("deep_gemm lacks fp8_paged_mqa_logits (the V3.2 indexer kernels)")
        self.context_lens_2d = self.api == "fp8_fp4"
        self.require_cuda = require_cuda
        self.dg = module

    def _num_sms(self, device: torch.device) -> int:
        if hasattr(self.dg, "get_num_sms"):  # the kernel checks the metadata against its own count
            return int(self.dg.get_num_sms())
        return torch.cuda.get_device_properties(device).multi_processor_count

    def _native(self, q: torch.Tensor, k_cache: torch.Tensor) -> bool:
        return (
            (q.is_cuda or not self.require_cuda)
            and q.dim() == 4
            and q.dtype == FP8_DTYPE
            and k_cache.dtype == torch.uint8
            and k_cache.dim() == 3
            and k_cache.shape[1] == INDEXER_PAGE_SIZE
            and k_cache.shape[2] == q.shape[-1] + torch_indexer.SCALE_BYTES
            and q.shape[2] in INDEXER_HEADS
            and q.shape[3] == INDEXER_HEAD_DIM
            and q.shape[0] * q.shape[1] > 0
        )

    def _paged_logits(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        weights: torch.Tensor,
        lens: torch.Tensor,
        tables: torch.Tensor,
        length: int,
    ) -> torch.Tensor:
        """The kernel's fp32 ``[rows, length]`` logits, garbage past each row's length."""
        meta = self.dg.get_paged_mqa_logits_metadata(lens, kv_cache.shape[1], self._num_sms(q.device))
        if self.api == "fp8_fp4":  # q is (fp8 values, None: no FP4 scales)
            return self.dg.fp8_fp4_paged_mqa_logits(
                (q, None), kv_cache, weights, lens, tables, meta, length, False
            )
        return self.dg.fp8_paged_mqa_logits(q, kv_cache, weights, lens, tables, meta, length, False)

    def indexer_topk(
        self,
        q: torch.Tensor,
        weights: torch.Tensor,
        k_cache: torch.Tensor,
        block_table: torch.Tensor,
        cache_seqlens: torch.Tensor,
        topk: int,
    ) -> torch.Tensor:
        if not self._native(q, k_cache):
            return torch_indexer.indexer_topk(q, weights, k_cache, block_table, cache_seqlens, topk)
        bsz, s_q, heads, dim = q.shape
        blocks, block_size, width = k_cache.shape
        rows, length = bsz * s_q, block_table.shape[1] * block_size
        context = query_context_lens(cache_seqlens, s_q)
        lens = context.view(rows, 1) if self.context_lens_2d else context
        tables = block_table.to(torch.int32)
        if s_q > 1:
            tables = tables.repeat_interleave(s_q, dim=0)
        logits = self._paged_logits(
            q.reshape(rows, 1, heads, dim).contiguous(),
            k_cache.view(blocks, block_size, 1, width),
            weights.reshape(rows, heads).float().contiguous(),
            lens,
            tables.contiguous(),
            length,
        )
        visible = torch_indexer.visible_keys(cache_seqlens, s_q, length)  # past a row's length: garbage
        logits = torch.where(visible, logits.view(bsz, s_q, length), float("-inf"))
        return torch_indexer.select_topk(logits, topk)


def query_context_lens(cache_seqlens: torch.Tensor, s_q: int) -> torch.Tensor:
    """int32 ``[B * s_q]``: how many keys each query sees (bottom-right causal), row-major."""
    offsets = torch.arange(1 - s_q, 1, device=cache_seqlens.device)
    lens = cache_seqlens.long()[:, None] + offsets[None, :]
    return lens.clamp_min(0).to(torch.int32).reshape(-1).contiguous()


def sparse_lse_base(sparse_fwd: Callable[..., Any]) -> str | None:
    """The base of ``flash_mla_sparse_fwd``'s LSE read from its signature: "e", "2", or None.

    The V3.2 release generation (c28eca9 .. 1408756) takes ``(q, kv, indices, sm_scale, d_v)``
    and documents "lse: 2-based log-sum-exp" (its test's reference is log2-sum-exp2). FlashMLA
    082094b (2026-01-16, #150) added ``attn_sink`` and ``topk_length`` and made the LSE natural
    (tests/ref.py: ``torch.logsumexp``), as at the pinned 9241ae3. A signature that cannot be read
    or takes ``*args``/``**kwargs`` says nothing: None.
    """
    params = declared_parameters(sparse_fwd)
    if params is None or any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        return None
    names = {p.name for p in params}
    return "e" if {"attn_sink", "topk_length"} & names else "2"


def sparse_head_dims(sparse_fwd: Callable[..., Any]) -> tuple[int, ...]:
    """The query/key widths ``flash_mla_sparse_fwd`` takes, read from its signature: 576 (V3.2)
    in every generation, and 512 (DeepSeek-V4, "MODEL1") from 082094b on, the commit that also
    added ``attn_sink`` and ``topk_length`` (:func:`sparse_lse_base` reads the same marker). A
    signature that says nothing: 576 only, since no call can tell the generations apart safely."""
    if sparse_lse_base(sparse_fwd) == "e":
        return (SPARSE_HEAD_DIM, V4_HEAD_DIM)
    return (SPARSE_HEAD_DIM,)


def measure_lse_base(sparse_fwd: Callable[..., Any], device: torch.device) -> str:
    """The base of ``sparse_fwd``'s LSE from one tiny call: zero queries and keys make every score
    0, so the LSE of 128 keys is ln 128 (natural) or exactly 7 (base 2)."""
    q = torch.zeros(1, SPARSE_HEADS[0], SPARSE_HEAD_DIM, dtype=torch.bfloat16, device=device)
    kv = torch.zeros(LSE_PROBE_KEYS, 1, SPARSE_HEAD_DIM, dtype=torch.bfloat16, device=device)
    indices = torch.arange(LSE_PROBE_KEYS, dtype=torch.int32, device=device).view(1, 1, -1)
    value = float(sparse_fwd(q, kv, indices, 1.0, SPARSE_HEAD_DIM_V)[2][0, 0])
    for base, expected in (("e", math.log(LSE_PROBE_KEYS)), ("2", math.log2(LSE_PROBE_KEYS))):
        if abs(value - expected) < 1e-2:
            return base
    raise RuntimeError(f"flash_mla_sparse_fwd gave LSE {value} for {LSE_PROBE_KEYS} zero scores")


class FlashMlaSparseAdapter:
    """UNVERIFIED. Sparse MLA decode through FlashMLA's ``flash_mla_sparse_fwd``.

    ``lse_base`` ("e" or "2") is read from the function's signature when it is built
    (:func:`sparse_lse_base`); when the signature says nothing, one tiny call measures it
    (:func:`measure_lse_base`): here when ``device`` is a CUDA device (``select_ops`` passes it),
    else at the first call on the GPU. ``lse_probe`` says how it was settled ("signature",
    "measured", or "pending"). ``head_dims``: the query widths sent to the kernel (576, and 512 for
    DeepSeek-V4 where the signature shows the MODEL1 generation: :func:`sparse_head_dims`); other
    widths go to the reference. ``require_cuda=False`` lets the tests run a stand-in on the CPU.
    """

    def __init__(
        self, module: ModuleType, *, device: torch.device | None = None, require_cuda: bool = True
    ) -> None:
        if not hasattr(module, "flash_mla_sparse_fwd"):
            raise ImportError("flash_mla lacks flash_mla_sparse_fwd (the V3.2 sparse kernels)")
        self.fm = module
        self.require_cuda = require_cuda
        self.lse_base = sparse_lse_base(module.flash_mla_sparse_fwd)
        self.head_dims = sparse_head_dims(module.flash_mla_sparse_fwd)
        self.lse_probe = "signature" if self.lse_base is not None else "pending"
        if self.lse_base is None and device is not None and torch.device(device).type == "cuda":
            self._measure_lse_base(torch.device(device))

    def _measure_lse_base(self, device: torch.device) -> str:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("FlashMlaSparseAdapter: run one call before CUDA-graph capture (LSE probe)")
        self.lse_base = measure_lse_base(self.fm.flash_mla_sparse_fwd, device)
        self.lse_probe = "measured"
        return self.lse_base

    def _native(self, q: torch.Tensor, k_cache: torch.Tensor, indices: torch.Tensor, head_dim_v: int) -> bool:
        return (
            (q.is_cuda or not self.require_cuda)
            and q.dim() == 4
            and q.dtype == torch.bfloat16
            and k_cache.dtype == torch.bfloat16
            and k_cache.dim() == 4
            and k_cache.shape[2:] == (1, q.shape[-1])
            and q.shape[-1] in self.head_dims
            and head_dim_v == SPARSE_HEAD_DIM_V
            and 0 < q.shape[2] <= SPARSE_HEADS[-1]
            and indices.shape[-1] > 0
            and q.shape[0] * q.shape[1] > 0
        )

    def sparse_mla_decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        indices: torch.Tensor,
        head_dim_v: int,
        softmax_scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._native(q, k_cache, indices, head_dim_v):
            return torch_sparse_mla.sparse_mla_decode(q, k_cache, indices, head_dim_v, softmax_scale)
        base = self.lse_base or self._measure_lse_base(q.device)
        bsz, s_q, heads, dim = q.shape
        rows, topk = bsz * s_q, indices.shape[-1]
        padded_heads = next(h for h in SPARSE_HEADS if h >= heads)
        q_rows = q.reshape(rows, heads, dim)
        if padded_heads != heads:
            q_rows = torch.nn.functional.pad(q_rows, (0, 0, 0, padded_heads - heads))
        idx = indices.reshape(rows, 1, topk).to(torch.int32)
        pad = (-topk) % SPARSE_TOPK_MULTIPLE
        if pad:
            idx = torch.nn.functional.pad(idx, (0, pad), value=-1)
        out, _, lse = self.fm.flash_mla_sparse_fwd(
            q_rows.contiguous(), k_cache.view(-1, 1, dim), idx.contiguous(), softmax_scale, head_dim_v
        )
        lse = lse[:, :heads].float()
        if base == "2":
            lse = lse * math.log(2.0)
        empty = (indices < 0).all(dim=-1).reshape(rows, 1)  # the V3.2 generation leaves these undefined
        out = torch.where(empty[..., None], 0.0, out[:, :heads].float()).to(q.dtype)
        lse = torch.where(empty, float("inf"), lse)
        return out.view(bsz, s_q, heads, head_dim_v), lse.view(bsz, s_q, heads).permute(0, 2, 1).contiguous()
