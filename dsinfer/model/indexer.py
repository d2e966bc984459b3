"""DeepSeek-V3.2's lightning indexer: which earlier tokens each query's sparse MLA attends to.

Per token ``x`` (the attention input) with MLA's query LoRA ``q_lora = q_a_layernorm(q_a_proj(x))``:

    q = wq_b(q_lora)                     [n_heads, head_dim]   RoPE on the first qk_rope_head_dim
    k = k_norm(wk(x))                    [head_dim]            (LayerNorm), RoPE likewise
    w = weights_proj(x) * n_heads^-0.5 * head_dim^-0.5
    logit(t) = sum_h w_h * relu(q_h . k_t)        over the cached keys t the token sees

and MLA attends only to the ``index_topk`` keys of highest logit. The indexer's RoPE rotates
halves (``x[:d/2]``, ``x[d/2:]``), not MLA's interleaved pairs. Keys are cached per token in the
layer's ``indexer`` cache (dsinfer/base/kv_spec.py). With an FP8 key cache (DeepSeek's release,
the GPU default) the query and key are rotated by a normalised Hadamard transform and quantised to
e4m3 (one scale per key, one per query head, the latter folded into ``w``); with a plain one they
are kept as computed, which is what transformers' DeepseekV32ForCausalLM does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dsinfer.base.config import ModelConfig
from dsinfer.model.batch import ForwardBatch
from dsinfer.model.layers import LayerNorm, Linear, RotaryEmbedding
from dsinfer.ops import Ops
from dsinfer.ops.indexer import hadamard, quantize_per_row, write_keys

# fp32 indexer logits one block of a prefill chunk's queries may take (the chunk is scored block by
# block, so a long chunk over a long context stays within it): 2^26 floats = 256 MiB
LOGITS_BUDGET = 1 << 26


@dataclass(frozen=True)
class IndexerQuery:
    """The indexer's query side of a step's tokens, row for row with the step's tokens."""

    q: torch.Tensor  # [T, n_heads, head_dim]; e4m3 with an FP8 key cache
    weights: torch.Tensor  # fp32 [T, n_heads]

    def rows(self, start: int, stop: int | None = None) -> IndexerQuery:
        return IndexerQuery(self.q[start:stop], self.weights[start:stop])

    def take(self, rows: torch.Tensor) -> IndexerQuery:
        return IndexerQuery(self.q[rows], self.weights[rows])


class Indexer(nn.Module):
    def __init__(self, config: ModelConfig, ops: Ops) -> None:
        super().__init__()
        assert config.index_n_heads and config.index_head_dim and config.index_topk and config.q_lora_rank
        self.ops = ops
        self.n_heads, self.head_dim, self.topk = (
            config.index_n_heads,
            config.index_head_dim,
            config.index_topk,
        )
        self.rope_dim = config.qk_rope_head_dim
        self.wq_b = Linear(config.q_lora_rank, self.n_heads * self.head_dim, ops)
        self.wk = Linear(config.hidden_size, self.head_dim, ops)
        self.k_norm = LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = Linear(config.hidden_size, self.n_heads, ops)
        self.rotary = RotaryEmbedding(config.rope, self.rope_dim, interleaved=False)
        self.weight_scale = self.n_heads**-0.5 * self.head_dim**-0.5

    def project(
        self, x: torch.Tensor, q_lora: torch.Tensor, batch: ForwardBatch, key_cache: torch.Tensor
    ) -> IndexerQuery:
        """The step's queries and weights; the new tokens' keys go into ``key_cache``."""
        cos_sin = batch.rope_cos_sin(self.rotary, x.dtype)
        q = self._rope(self.wq_b(q_lora).view(-1, self.n_heads, self.head_dim), cos_sin)
        k = self._rope(self.k_norm(self.wk(x)), cos_sin)
        weights = self.weights_proj(x).float() * self.weight_scale
        if key_cache.dtype == torch.uint8:  # FP8 keys (dsinfer/ops/indexer.py)
            q, k = hadamard(q), hadamard(k)
            q, q_scale = quantize_per_row(q)
            weights = weights * q_scale
        write_keys(key_cache, batch.slot_mapping, k)
        return IndexerQuery(q, weights)

    def _rope(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        pe, rest = x.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        return torch.cat([self.rotary(pe, cos_sin), rest], dim=-1)

    def select(
        self,
        query: IndexerQuery,
        key_cache: torch.Tensor,
        block_tables: torch.Tensor,
        cache_seqlens: torch.Tensor,
    ) -> torch.Tensor:
        """Positions int32 ``[B, s_q, min(index_topk, slots of the block table)]`` (``-1`` past the
        visible keys) for ``B`` sequences of ``s_q`` new tokens each, whose rows ``query`` holds
        sequence after sequence."""
        bsz = block_tables.shape[0]
        q = query.q.view(bsz, -1, self.n_heads, self.head_dim)
        weights = query.weights.view(bsz, -1, self.n_heads)
        return self.ops.indexer_topk(q, weights, key_cache, block_tables, cache_seqlens, self.topk)

    def selected_mask(
        self,
        query: IndexerQuery,
        key_cache: torch.Tensor,
        block_table: torch.Tensor,
        kv_len: int,
    ) -> torch.Tensor:
        """bool ``[q_len, kv_len]``: the keys picked for each of one sequence's ``q_len`` new tokens
        (its last ones; ``block_table`` is its row ``[1, pages]``), scored in blocks of queries whose
        logits fit ``LOGITS_BUDGET``."""
        q_len = query.q.shape[0]
        mask = torch.zeros(q_len, kv_len + 1, dtype=torch.bool, device=block_table.device)
        rows = max(1, LOGITS_BUDGET // (block_table.shape[1] * key_cache.shape[1]))
        for start in range(0, q_len, rows):
            stop = min(start + rows, q_len)
            # the block's last query is new token stop - 1: it sees kv_len - q_len + stop keys
            lens = torch.tensor([kv_len - q_len + stop], dtype=torch.int32, device=block_table.device)
            positions = self.select(query.rows(start, stop), key_cache, block_table, lens)[0].long()
            positions = torch.where(positions >= 0, positions, kv_len)  # unused -> the dropped column
            mask[start:stop].scatter_(1, positions, True)
        return mask[:, :kv_len]
