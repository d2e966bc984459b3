"""Multi-head latent attention with its two equal computations.

Every token's K/V is compressed into one latent: ``c = kv_a_layernorm(c_kv)`` (kv_lora_rank) plus
the rotated shared key ``k_pe`` (qk_rope_head_dim), 576 values for DeepSeek-V3, stored per layer in
a paged cache ``[num_pages, page_size, 576]`` (FlashMLA's layout, ``V = c``).

- decompressed (prefill): K_nope and V of every head are rebuilt from c with kv_b_proj and ordinary
  attention runs with 192-wide keys.
- absorbed (decode): kv_b_proj's key rows are folded into the query (q_nope . W_uk) and its value
  rows into the output (o_latent . W_uv), so attention runs over the cache itself: one 576-wide
  key and 512-wide value head shared by all query heads.

kv_b_proj's rows are grouped per head: qk_nope_head_dim key rows, then v_head_dim value rows.

Sparse attention (DeepSeek-V3.2, ``config.is_sparse``): the layer's lightning indexer
(dsinfer/model/indexer.py) picks each query's ``index_topk`` keys among those it sees; the
decompressed path masks every other key, the absorbed path runs sparse MLA decode over the picked
cache slots (FlashMLA's sparse form).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from dsinfer.base.config import ModelConfig
from dsinfer.model.batch import ForwardBatch, LayerCache
from dsinfer.model.indexer import Indexer, IndexerQuery
from dsinfer.model.layers import Linear, RMSNorm, RotaryEmbedding
from dsinfer.ops import Ops
from dsinfer.ops.indexer import positions_to_slots
from dsinfer.ops.mla import absorb_query, unabsorb_output


class Projected(NamedTuple):
    """What the projections hand to core attention, a row per new token of the step."""

    q_nope: torch.Tensor  # [T, H, nope]
    q_pe: torch.Tensor  # [T, H, rope], rotated
    index: IndexerQuery | None  # the indexer's query (sparse attention only)

    def rows(self, start: int, stop: int | None = None) -> Projected:
        index = None if self.index is None else self.index.rows(start, stop)
        return Projected(self.q_nope[start:stop], self.q_pe[start:stop], index)

    def take(self, rows: torch.Tensor) -> Projected:
        index = None if self.index is None else self.index.take(rows)
        return Projected(self.q_nope[rows], self.q_pe[rows], index)


class MLA(nn.Module):
    def __init__(self, config: ModelConfig, ops: Ops) -> None:
        super().__init__()
        self.ops = ops
        self.num_heads = config.num_attention_heads
        self.nope_dim, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_dim, self.kv_lora_rank = config.v_head_dim, config.kv_lora_rank
        self.softmax_scale = config.softmax_scale
        hidden, q_out = config.hidden_size, self.num_heads * config.qk_head_dim
        self.q_lora_rank = config.q_lora_rank
        if self.q_lora_rank is None:
            self.q_proj = Linear(hidden, q_out, ops)
        else:
            self.q_a_proj = Linear(hidden, self.q_lora_rank, ops, bias=config.attention_bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, ops, config.rms_norm_eps)
            self.q_b_proj = Linear(self.q_lora_rank, q_out, ops)
        self.kv_a_proj_with_mqa = Linear(hidden, config.kv_cache_dim, ops, bias=config.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, ops, config.rms_norm_eps)
        self.kv_b_proj = Linear(self.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_dim), ops)
        self.o_proj = Linear(self.num_heads * self.v_dim, hidden, ops, bias=config.attention_bias)
        self.rotary = RotaryEmbedding(config.rope, self.rope_dim, config.rope_interleave)
        self.indexer = Indexer(config, ops) if config.is_sparse else None
        self.w_uk: torch.Tensor | None = None  # [H, nope, C], set by prepare_absorbed()
        self.w_uv_t: torch.Tensor | None = None  # [H, C, v], a view of [H, v, C]
        self.a_proj: Linear | None = None  # q_a_proj and kv_a_proj_with_mqa stacked, set by stack_a_proj()

    def stack_a_proj(self) -> None:
        """After loading: q_a_proj and kv_a_proj_with_mqa read the same input, so run them as one GEMM
        of their stacked rows (V3: N = 1536 + 576; on a GPU kv_a alone fills 18 of 132 SMs at
        decode). Both keep views of the stack's rows."""
        if self.q_lora_rank is not None and self.a_proj is None:
            self.a_proj = Linear.stack([self.q_a_proj, self.kv_a_proj_with_mqa])

    def prepare_absorbed(self, dtype: torch.dtype) -> None:
        """Split kv_b_proj per head for the absorbed path (after weights are loaded), each half in a
        layout a batched GEMM reads without a copy (a view straddling both halves would be copied
        by every step's bmm on CPU). ``w_uv_t`` is the transposed view of a contiguous
        ``[H, v, C]``: the CPU kernel unfolds from rows of that (``ops/mla_cpu.py``)."""
        w = self.kv_b_proj.dense_weight(dtype).view(self.num_heads, self.nope_dim + self.v_dim, -1)
        self.w_uk = w[:, : self.nope_dim].contiguous()
        self.w_uv_t = w[:, self.nope_dim :].contiguous().transpose(1, 2)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv_cache: LayerCache) -> torch.Tensor:
        return self.attend(self.project(x, batch, kv_cache), batch, kv_cache)

    # Stage 1: projections; the new tokens' latents (and indexer keys) go into the cache.
    def project(self, x: torch.Tensor, batch: ForwardBatch, kv_cache: LayerCache) -> Projected:
        q_lora = None
        if self.a_proj is not None:
            q_a, kv_a = self.a_proj(x).split([self.q_lora_rank, self.kv_a_proj_with_mqa.out_features], dim=-1)
        else:
            q_a = self.q_a_proj(x) if self.q_lora_rank is not None else None
            kv_a = self.kv_a_proj_with_mqa(x)
        if q_a is None:
            q = self.q_proj(x)
        else:
            q_lora = self.q_a_layernorm(q_a)
            q = self.q_b_proj(q_lora)
        q = q.view(-1, self.num_heads, self.nope_dim + self.rope_dim)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        cos_sin = batch.rope_cos_sin(self.rotary, q.dtype)
        q_pe = self.rotary(q_pe, cos_sin)
        c_kv, k_pe = kv_a.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = torch.cat([self.kv_a_layernorm(c_kv), self.rotary(k_pe, cos_sin)], dim=-1)
        kv_cache.latent.view(-1, latent.shape[-1])[batch.slot_mapping] = latent.to(kv_cache.latent.dtype)
        if self.indexer is None:
            return Projected(q_nope, q_pe, None)
        assert q_lora is not None and kv_cache.indexer is not None
        return Projected(q_nope, q_pe, self.indexer.project(x, q_lora, batch, kv_cache.indexer))

    # Stage 2: core attention and the output projection.
    def attend(self, q: Projected, batch: ForwardBatch, kv_cache: LayerCache) -> torch.Tensor:
        if batch.num_absorbed == batch.num_seqs:  # a decode step: no prefill chunk
            out = self._absorbed_padded(q, batch, kv_cache)
        elif batch.num_absorbed == 0:
            out = self._decompressed(q, batch, kv_cache)
        else:
            split = batch.num_decompressed_tokens
            out = torch.cat(
                [
                    self._decompressed(q.rows(0, split), batch, kv_cache),
                    self._absorbed_padded(q.rows(split), batch, kv_cache),
                ]
            )
        return self.o_proj(out.flatten(1))

    def _absorbed_padded(self, q: Projected, batch: ForwardBatch, kv_cache: LayerCache) -> torch.Tensor:
        if batch.absorbed_padding is None:
            return self._absorbed(q, batch, kv_cache)
        gather, keep = batch.absorbed_padding
        return self._absorbed(q.take(gather), batch, kv_cache)[keep]

    def _selected(
        self,
        index: IndexerQuery,
        rows: tuple[int, int],
        seq: int,
        kv_len: int,
        batch: ForwardBatch,
        cache: LayerCache,
    ) -> torch.Tensor:
        """bool [q_len, kv_len]: the keys sequence ``seq``'s new tokens (``rows`` of the step) attend to."""
        assert self.indexer is not None and cache.indexer is not None
        table = batch.block_tables[seq : seq + 1]
        return self.indexer.selected_mask(index.rows(*rows), cache.indexer, table, kv_len)

    def _decompressed(self, projected: Projected, batch: ForwardBatch, kv_cache: LayerCache) -> torch.Tensor:
        index = projected.index
        q = torch.cat([projected.q_nope, projected.q_pe], dim=-1)  # [T, H, nope + rope]
        n = batch.num_decompressed
        q_lens, kv_lens = batch.q_lens[:n], batch.kv_lens[:n]
        # Fresh prompts of similar lengths run as one padded batch; otherwise one sequence at a time.
        if n > 1 and q_lens == kv_lens and n * max(q_lens) <= 2 * sum(q_lens):
            return self._decompressed_padded(q, index, batch, kv_cache)
        out = q.new_empty(q.shape[0], self.num_heads, self.v_dim)
        cache = kv_cache.latent
        page_size = cache.shape[1]
        start = 0
        seqs = range(batch.num_decompressed)
        for i, q_len, kv_len in zip(seqs, batch.q_lens, batch.kv_lens, strict=False):
            num_pages = -(-kv_len // page_size)
            pages = batch.block_tables[i, :num_pages].long()
            latent = cache[pages].flatten(0, 1)[:kv_len].to(q.dtype)  # [S, C + rope]
            c, k_pe = latent.split([self.kv_lora_rank, self.rope_dim], dim=-1)
            kv = self.kv_b_proj(c).view(kv_len, self.num_heads, self.nope_dim + self.v_dim)
            k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
            k = torch.cat([k_nope, k_pe[:, None, :].expand(-1, self.num_heads, -1)], dim=-1)
            # Bottom-right causal mask: new token j sees the prefix and new tokens 0..j.
            visible = torch.arange(kv_len, device=q.device)[None, :] <= (
                torch.arange(q_len, device=q.device)[:, None] + (kv_len - q_len)
            )
            if index is not None:  # the picked keys (all visible)
                visible = self._selected(index, (start, start + q_len), i, kv_len, batch, kv_cache)
            o = F.scaled_dot_product_attention(
                q[start : start + q_len].transpose(0, 1),  # [H, q, d]
                k.transpose(0, 1),
                v.transpose(0, 1),
                attn_mask=visible,
                scale=self.softmax_scale,
            )
            out[start : start + q_len] = o.transpose(0, 1)
            start += q_len
        return out

    def _decompressed_padded(
        self, q: torch.Tensor, index: IndexerQuery | None, batch: ForwardBatch, kv_cache: LayerCache
    ) -> torch.Tensor:
        """Sequences with no cached prefix: pad to [n, L], decompress once, one causal attention."""
        n = batch.num_decompressed
        lens = torch.tensor(batch.q_lens[:n], device=q.device)
        cache = kv_cache.latent
        length, page_size = int(lens.max()), cache.shape[1]
        pos = torch.arange(length, device=q.device)
        valid = pos[None, :] < lens[:, None]  # [n, L]
        pages = batch.block_tables[:n, (pos // page_size).clamp(max=batch.block_tables.shape[1] - 1)].long()
        latent = cache.view(-1, cache.shape[-1])[pages * page_size + pos % page_size].to(q.dtype)
        c, k_pe = latent.split([self.kv_lora_rank, self.rope_dim], dim=-1)  # [n, L, C], [n, L, rope]
        kv = self.kv_b_proj(c).view(n, length, self.num_heads, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_pe[:, :, None, :].expand(-1, -1, self.num_heads, -1)], dim=-1)
        flat = valid.view(-1).nonzero().squeeze(1)  # padded row of each packed token, in order
        q_pad = q.new_zeros(n * length, self.num_heads, q.shape[-1]).index_copy_(0, flat, q)
        # causal within each sequence; a padding query sees key 0 only (its output is dropped)
        mask = (pos[None, :, None] >= pos[None, None, :]) & (valid[:, None, :] | (pos == 0)[None, None, :])
        if index is not None:  # valid queries see the keys picked for them only
            start = 0
            for i, q_len in enumerate(batch.q_lens[:n]):
                mask[i, :q_len, :q_len] = self._selected(
                    index, (start, start + q_len), i, q_len, batch, kv_cache
                )
                start += q_len
        o = F.scaled_dot_product_attention(
            q_pad.view(n, length, self.num_heads, -1).transpose(1, 2),  # [n, H, L, d]
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask[:, None],
            scale=self.softmax_scale,
        )
        return o.transpose(1, 2).reshape(n * length, self.num_heads, self.v_dim)[flat]

    def _absorbed(self, projected: Projected, batch: ForwardBatch, kv_cache: LayerCache) -> torch.Tensor:
        q_nope, q_pe, index = projected
        assert self.w_uk is not None and self.w_uv_t is not None, "prepare_absorbed() was not called"
        num_tokens, first = q_nope.shape[0], batch.num_decompressed
        if num_tokens == 0:
            return q_nope.new_empty(0, self.num_heads, self.v_dim)
        assert batch.cache_seqlens is not None  # built once per step by ForwardBatch
        cache, tables = kv_cache.latent, batch.block_tables[first:]
        if index is None:  # [B, s_q, H, .]: every absorbed sequence has as many new tokens
            per_seq = (batch.num_absorbed, -1, self.num_heads)
            out = self.ops.mla_decode_absorbed(
                q_nope.view(*per_seq, self.nope_dim),
                q_pe.view(*per_seq, self.rope_dim),
                self.w_uk,
                self.w_uv_t,
                cache.unsqueeze(2),
                tables,
                batch.cache_seqlens,
                softmax_scale=self.softmax_scale,
                causal=True,
            )
            return out.view(num_tokens, self.num_heads, self.v_dim)
        q = absorb_query(q_nope, q_pe, self.w_uk).view(
            batch.num_absorbed, -1, self.num_heads, self.kv_lora_rank + self.rope_dim
        )
        assert self.indexer is not None and kv_cache.indexer is not None
        positions = self.indexer.select(index, kv_cache.indexer, tables, batch.cache_seqlens)
        o_latent, _ = self.ops.sparse_mla_decode(
            q.to(cache.dtype),
            cache.unsqueeze(2),
            positions_to_slots(positions, tables, cache.shape[1]),
            head_dim_v=self.kv_lora_rank,
            softmax_scale=self.softmax_scale,
        )
        o_latent = o_latent.reshape(num_tokens, self.num_heads, self.kv_lora_rank)
        return unabsorb_output(o_latent, self.w_uv_t, q_nope.dtype)
