"""Adapters from V3.2's sparse-attention entry points to DeepGEMM and FlashMLA.

UNVERIFIED: neither library can be installed on the machines this project is developed on. These
adapters follow the documented APIs (DeepGEMM's README and tests for the V3.2 MQA logits kernels,
FlashMLA's README for the sparse kernels), are constructed only when the import succeeds on a CUDA
device, and send what they cannot express to the torch reference, whose semantics they share.

- ``DeepGemmIndexerAdapter.indexer_topk``: ``fp8_paged_mqa_logits`` over the FP8 key cache (uint8
  ``[blocks, page_size, D + 4]``, DeepGEMM's fused layout, which is the pool's FP8 indexer format)
  with an e4m3 query whose scales are folded into ``weights``; then the shared top-k. A plain key
  cache or query goes to the reference.
- ``FlashMlaSparseAdapter.sparse_mla_decode``: ``flash_mla_sparse_fwd`` (token-level sparse MQA,
  bf16 KV, FlashMLA's "sparse prefill" kernel, which takes any number of query rows) over the bf16
  latent cache viewed as one flat ``[slots, 1, 576]`` tensor, so the indices are the cache slots
  themselves. FlashMLA's sparse *decode* kernel (``flash_mla_with_kvcache(..., is_fp8_kvcache=True,
  indices=...)``) needs the latent in its 656-byte FP8 format, which the pool does not keep yet.
"""

from __future__ import annotations

import math
from types import ModuleType

import torch

from dsinfer.ops import indexer as torch_indexer
from dsinfer.ops import sparse_mla as torch_sparse_mla
from dsinfer.ops.fp8 import FP8_DTYPE

__all__ = ["DeepGemmIndexerAdapter", "FlashMlaSparseAdapter"]

SPARSE_HEAD_MULTIPLE = 64  # FlashMLA's sparse kernels run 64 or 128 query heads
SPARSE_TOPK_MULTIPLE = 64  # and top-k in whole 64-key tiles (padding indices are -1)


class DeepGemmIndexerAdapter:
    def __init__(self, module: ModuleType) -> None:
        for name in ("fp8_paged_mqa_logits", "get_paged_mqa_logits_metadata"):
            if not hasattr(module, name):
                raise ImportError(f"deep_gemm lacks {name} (the V3.2 indexer kernels)")
        self.dg = module

    def _num_sms(self, device: torch.device) -> int:
        if hasattr(self.dg, "get_num_sms"):
            return int(self.dg.get_num_sms())
        return torch.cuda.get_device_properties(device).multi_processor_count

    def _metadata(self, cache_seqlens: torch.Tensor, block_size: int) -> object:
        """Schedule metadata; the V3.2 release takes the block size, newer releases do not."""
        num_sms = self._num_sms(cache_seqlens.device)
        try:
            return self.dg.get_paged_mqa_logits_metadata(cache_seqlens, block_size, num_sms)
        except TypeError:
            return self.dg.get_paged_mqa_logits_metadata(cache_seqlens, num_sms)

    def indexer_topk(
        self,
        q: torch.Tensor,
        weights: torch.Tensor,
        k_cache: torch.Tensor,
        block_table: torch.Tensor,
        cache_seqlens: torch.Tensor,
        topk: int,
    ) -> torch.Tensor:
        if k_cache.dtype != torch.uint8 or q.dtype != FP8_DTYPE or not q.is_cuda:
            return torch_indexer.indexer_topk(q, weights, k_cache, block_table, cache_seqlens, topk)
        bsz, s_q, heads, _ = q.shape
        blocks, block_size, width = k_cache.shape
        seqlens = cache_seqlens.to(torch.int32).contiguous()
        logits = self.dg.fp8_paged_mqa_logits(
            q.contiguous(),
            k_cache.view(blocks, block_size, 1, width),
            weights.reshape(bsz * s_q, heads).float().contiguous(),
            seqlens,
            block_table.to(torch.int32).contiguous(),
            self._metadata(seqlens, block_size),
            block_table.shape[1] * block_size,
            True,  # clean_logits: -inf where a key is not visible
        )
        return torch_indexer.select_topk(logits.view(bsz, s_q, -1), topk)


class FlashMlaSparseAdapter:
    def __init__(self, module: ModuleType) -> None:
        if not hasattr(module, "flash_mla_sparse_fwd"):
            raise ImportError("flash_mla lacks flash_mla_sparse_fwd (the V3.2 sparse kernels)")
        self.fm = module

    def sparse_mla_decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        indices: torch.Tensor,
        head_dim_v: int,
        softmax_scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if q.dtype != torch.bfloat16 or k_cache.dtype != torch.bfloat16 or not q.is_cuda:
            return torch_sparse_mla.sparse_mla_decode(q, k_cache, indices, head_dim_v, softmax_scale)
        bsz, s_q, heads, dim = q.shape
        rows, topk = bsz * s_q, indices.shape[-1]
        padded_heads = -(-heads // SPARSE_HEAD_MULTIPLE) * SPARSE_HEAD_MULTIPLE
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
        empty = (indices < 0).all(dim=-1).reshape(rows, 1)  # [rows, 1]: FlashMLA leaves these undefined
        out = torch.where(empty[..., None], 0.0, out[:, :heads].float()).to(q.dtype)
        lse = torch.where(empty, float("inf"), lse[:, :heads].float() * math.log(2.0))  # log2 -> natural
        return out.view(bsz, s_q, heads, head_dim_v), lse.view(bsz, s_q, heads).permute(0, 2, 1).contiguous()
