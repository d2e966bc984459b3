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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsinfer.base.config import ModelConfig
from dsinfer.model.batch import ForwardBatch
from dsinfer.model.layers import Linear, RMSNorm, RotaryEmbedding
from dsinfer.ops import Ops


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
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = Linear(self.q_lora_rank, q_out, ops)
        self.kv_a_proj_with_mqa = Linear(hidden, config.kv_cache_dim, ops, bias=config.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, config.rms_norm_eps)
        self.kv_b_proj = Linear(self.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_dim), ops)
        self.o_proj = Linear(self.num_heads * self.v_dim, hidden, ops, bias=config.attention_bias)
        self.rotary = RotaryEmbedding(config.rope, self.rope_dim, config.rope_interleave)
        self.w_uk: torch.Tensor | None = None  # [H, nope, C], set by prepare_absorbed()
        self.w_uv: torch.Tensor | None = None  # [H, v, C]

    def prepare_absorbed(self, dtype: torch.dtype) -> None:
        """Split kv_b_proj per head for the absorbed path (after weights are loaded)."""
        w = self.kv_b_proj.dense_weight(dtype).view(self.num_heads, self.nope_dim + self.v_dim, -1)
        self.w_uk, self.w_uv = w[:, : self.nope_dim], w[:, self.nope_dim :]

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        q_nope, q_pe = self.project(x, batch, kv_cache)
        return self.attend(q_nope, q_pe, batch, kv_cache)

    # Stage 1: projections; the new tokens' latents go into the cache.
    def project(
        self, x: torch.Tensor, batch: ForwardBatch, kv_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(-1, self.num_heads, self.nope_dim + self.rope_dim)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        cos_sin = batch.rope_cos_sin(self.rotary.cos_sin, q.dtype)
        q_pe = self.rotary(q_pe, cos_sin)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = torch.cat([self.kv_a_layernorm(c_kv), self.rotary(k_pe, cos_sin)], dim=-1)
        kv_cache.view(-1, latent.shape[-1])[batch.slot_mapping] = latent.to(kv_cache.dtype)
        return q_nope, q_pe

    # Stage 2: core attention and the output projection.
    def attend(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, batch: ForwardBatch, kv_cache: torch.Tensor
    ) -> torch.Tensor:
        split = batch.num_decompressed_tokens
        out = torch.cat(
            [
                self._decompressed(q_nope[:split], q_pe[:split], batch, kv_cache),
                self._absorbed(q_nope[split:], q_pe[split:], batch, kv_cache),
            ]
        )
        return self.o_proj(out.flatten(1))

    def _decompressed(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, batch: ForwardBatch, kv_cache: torch.Tensor
    ) -> torch.Tensor:
        q = torch.cat([q_nope, q_pe], dim=-1)  # [T, H, nope + rope]
        n = batch.num_decompressed
        q_lens, kv_lens = batch.q_lens[:n], batch.kv_lens[:n]
        # Fresh prompts of similar lengths run as one padded batch; otherwise one sequence at a time.
        if n > 1 and q_lens == kv_lens and n * max(q_lens) <= 2 * sum(q_lens):
            return self._decompressed_padded(q, batch, kv_cache)
        out = q.new_empty(q.shape[0], self.num_heads, self.v_dim)
        page_size = kv_cache.shape[1]
        start = 0
        seqs = range(batch.num_decompressed)
        for i, q_len, kv_len in zip(seqs, batch.q_lens, batch.kv_lens, strict=False):
            num_pages = -(-kv_len // page_size)
            pages = batch.block_tables[i, :num_pages].long()
            latent = kv_cache[pages].flatten(0, 1)[:kv_len].to(q.dtype)  # [S, C + rope]
            c, k_pe = latent.split([self.kv_lora_rank, self.rope_dim], dim=-1)
            kv = self.kv_b_proj(c).view(kv_len, self.num_heads, self.nope_dim + self.v_dim)
            k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
            k = torch.cat([k_nope, k_pe[:, None, :].expand(-1, self.num_heads, -1)], dim=-1)
            # Bottom-right causal mask: new token j sees the prefix and new tokens 0..j.
            visible = torch.arange(kv_len, device=q.device)[None, :] <= (
                torch.arange(q_len, device=q.device)[:, None] + (kv_len - q_len)
            )
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
        self, q: torch.Tensor, batch: ForwardBatch, kv_cache: torch.Tensor
    ) -> torch.Tensor:
        """Sequences with no cached prefix: pad to [n, L], decompress once, one causal attention."""
        n = batch.num_decompressed
        lens = torch.tensor(batch.q_lens[:n], device=q.device)
        length, page_size = int(lens.max()), kv_cache.shape[1]
        pos = torch.arange(length, device=q.device)
        valid = pos[None, :] < lens[:, None]  # [n, L]
        pages = batch.block_tables[:n, (pos // page_size).clamp(max=batch.block_tables.shape[1] - 1)].long()
        latent = kv_cache.view(-1, kv_cache.shape[-1])[pages * page_size + pos % page_size].to(q.dtype)
        c, k_pe = latent.split([self.kv_lora_rank, self.rope_dim], dim=-1)  # [n, L, C], [n, L, rope]
        kv = self.kv_b_proj(c).view(n, length, self.num_heads, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_pe[:, :, None, :].expand(-1, -1, self.num_heads, -1)], dim=-1)
        flat = valid.view(-1).nonzero().squeeze(1)  # padded row of each packed token, in order
        q_pad = q.new_zeros(n * length, self.num_heads, q.shape[-1]).index_copy_(0, flat, q)
        # causal within each sequence; a padding query sees key 0 only (its output is dropped)
        mask = (pos[None, :, None] >= pos[None, None, :]) & (valid[:, None, :] | (pos == 0)[None, None, :])
        o = F.scaled_dot_product_attention(
            q_pad.view(n, length, self.num_heads, -1).transpose(1, 2),  # [n, H, L, d]
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask[:, None],
            scale=self.softmax_scale,
        )
        return o.transpose(1, 2).reshape(n * length, self.num_heads, self.v_dim)[flat]

    def _absorbed(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, batch: ForwardBatch, kv_cache: torch.Tensor
    ) -> torch.Tensor:
        assert self.w_uk is not None and self.w_uv is not None, "prepare_absorbed() was not called"
        num_tokens, first = q_nope.shape[0], batch.num_decompressed
        if num_tokens == 0:
            return q_nope.new_empty(0, self.num_heads, self.v_dim)
        q_latent = torch.einsum("thd,hdc->thc", q_nope, self.w_uk)
        q = torch.cat([q_latent, q_pe], dim=-1).view(
            batch.num_absorbed, -1, self.num_heads, q_pe.shape[-1] + q_latent.shape[-1]
        )
        assert batch.cache_seqlens is not None  # built once per step by ForwardBatch
        o_latent, _ = self.ops.mla_decode(
            q.to(kv_cache.dtype),
            kv_cache.unsqueeze(2),
            batch.block_tables[first:],
            batch.cache_seqlens,
            head_dim_v=self.kv_lora_rank,
            softmax_scale=self.softmax_scale,
            causal=True,
        )
        o_latent = o_latent.reshape(num_tokens, self.num_heads, self.kv_lora_rank).to(q_nope.dtype)
        return torch.einsum("thc,hvc->thv", o_latent, self.w_uv)
