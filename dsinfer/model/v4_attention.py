"""DeepSeek-V4 attention: shared-K=V multi-query attention over a sliding window of raw tokens and
(CSA, HCA layers) the compressed entries, with a learned sink per head.

Per new token: ``q = rmsnorm_per_head(wq_b(q_norm(wq_a x)))`` and one K=V row
``kv = norm(wkv x)``, both rotated on their trailing ``qk_rope_head_dim`` channels. The query
attends to the raw rows of its window (itself and the ``sliding_window - 1`` tokens before) and
to the entries it may see (``v4_compressor``; CSA: only those its indexer picked); the sink
``exp(sink_h)`` joins the softmax's denominator. The core is ``ops.sparse_mla_decode`` (FlashMLA's
sparse decode: one K=V head shared by every query head, each query over the keys it lists, here
all ``head_dim`` channels as values) over the window's rows and the entries, and the sink is
applied after it from its log-sum-exp: ``out * 1 / (1 + exp(sink - lse))``. As K is V, the
output's rope channels are rotated back by the query's angle. The output projection is grouped: ``o_groups`` blocks of
heads each to ``o_lora_rank`` by ``wo_a``, then ``wo_b``.
"""

from __future__ import annotations

import torch
from torch import nn

from dsinfer.base.v4_config import CSA, HCA, V4Config
from dsinfer.model.layers import Linear, RotaryEmbedding
from dsinfer.model.v4_compressor import Compressor, Indexer, IndexerRows, V4RMSNorm, entry_mask, rotate
from dsinfer.model.v4_state import LayerState, LayerUndo, SeriesUndo
from dsinfer.ops import Ops


class V4Attention(nn.Module):
    def __init__(self, config: V4Config, ops: Ops, layer: int) -> None:
        super().__init__()
        self.heads, self.head_dim, self.window = (
            config.num_attention_heads,
            config.head_dim,
            config.sliding_window,
        )
        self.groups, self.eps = config.o_groups, config.rms_norm_eps
        self.rate, self.ops = config.compress_rate(layer), ops
        self.wq_a = Linear(config.hidden_size, config.q_lora_rank, ops)
        self.q_norm = V4RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.wq_b = Linear(config.q_lora_rank, self.heads * self.head_dim, ops)
        self.wkv = Linear(config.hidden_size, self.head_dim, ops)
        self.norm = V4RMSNorm(self.head_dim, config.rms_norm_eps)
        per_group = self.heads * self.head_dim // self.groups
        self.wo_a = Linear(per_group, self.groups * config.o_lora_rank, ops)
        self.wo_b = Linear(self.groups * config.o_lora_rank, config.hidden_size, ops)
        self.attn_sink = nn.Parameter(torch.zeros(self.heads), requires_grad=False)
        kind = config.layer_kind(layer)
        self.compressor = (
            Compressor(config, ops, self.rate, self.head_dim, overlap=kind == CSA)
            if kind in (CSA, HCA)
            else None
        )
        self.indexer = Indexer(config, ops, self.rate) if kind == CSA else None
        self.rope = RotaryEmbedding(config.rope(layer), config.qk_rope_head_dim, interleaved=True)

    def forward(
        self,
        x: torch.Tensor,
        positions: list[torch.Tensor],
        states: list[LayerState],
        boundaries: list[int | None] | None = None,
        undo: list[bool] | None = None,
    ) -> torch.Tensor:
        """``x [T, hidden]``: the next tokens of one or more sequences, sequence i's the next
        ``len(positions[i])`` rows at ``positions[i]`` (consecutive, after the tokens ``states[i]``
        holds) -> [T, hidden]; each state takes its sequence's tokens in. The projections run over
        every token at once; the window, the compressors, the indexer and the attention per
        sequence. ``undo[i]``: sequence i's state keeps what :meth:`rewind` needs to take its last
        tokens back (a verification whose draft may be rejected)."""
        tokens = x.shape[0]
        where = torch.cat(positions)
        q_lora = self.q_norm(self.wq_a(x))
        q = self.wq_b(q_lora).view(tokens, self.heads, self.head_dim)
        q = q * torch.rsqrt(q.float().square().mean(-1, keepdim=True) + self.eps).to(q.dtype)
        q = rotate(self.rope, q, where)
        kv = rotate(self.rope, self.norm(self.wkv(x)), where)
        sizes = [p.shape[0] for p in positions]
        none: list[None] = [None] * len(sizes)
        compressed = none if self.compressor is None else _split_pair(self.compressor.project(x), sizes)
        indexed = (
            none if self.indexer is None else self.indexer.project(x, q_lora, where, self.rope).split(sizes)
        )
        marks = boundaries if boundaries is not None else none
        keeps = undo if undo is not None else [False] * len(sizes)
        parts = zip(
            q.split(sizes), kv.split(sizes), compressed, indexed, positions, states, marks, keeps, strict=True
        )
        out = torch.cat([self._sequence(*part) for part in parts])
        out = rotate(self.rope, out, where, inverse=True)
        grouped = out.reshape(tokens, self.groups, -1)
        weight = self.wo_a.dense_weight(grouped.dtype).view(self.groups, -1, grouped.shape[-1])
        mixed = torch.einsum("tgi,goi->tgo", grouped, weight).flatten(1)
        return self.wo_b(mixed)

    def _sequence(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        compressed: tuple[torch.Tensor, torch.Tensor] | None,
        indexed: IndexerRows | None,
        positions: torch.Tensor,
        state: LayerState,
        boundary: int | None,
        keep_undo: bool = False,
    ) -> torch.Tensor:
        """One sequence's attention output [T, H, D] (rope channels still rotated)."""
        if keep_undo:
            state.undo = LayerUndo(
                state.window,
                kv,
                None
                if compressed is None or state.compressed is None
                else SeriesUndo.before(state.compressed, compressed),
                None
                if indexed is None or state.indexer is None
                else SeriesUndo.before(state.indexer, (indexed.kv, indexed.gate)),
            )
        keys, mask = self._window(kv, positions, state, boundary)
        if self.compressor is not None:
            series = state.compressed
            assert series is not None and compressed is not None
            picks = None
            if self.indexer is not None:
                assert state.indexer is not None and indexed is not None
                picks = self.indexer.select(indexed, positions, state.indexer, self.rope, boundary)
            self.compressor.compress(compressed, series, self.rope, boundary)
            entries = series.entries.read()
            keys = torch.cat([keys, entries])
            mask = torch.cat([mask, entry_mask(positions, entries.shape[0], self.rate, picks)], dim=1)
        return self._attend(q, keys, mask)

    def rewind(self, state: LayerState, drop: int) -> None:
        """Take the last ``drop`` tokens of the step that kept ``state.undo`` back out of ``state``."""
        undo = state.undo
        assert undo is not None, "rewind needs the step's undo record"
        keep = undo.rows.shape[0] - drop
        window = torch.cat([undo.window, undo.rows[:keep]])
        state.window = (
            window[max(0, window.shape[0] - (self.window - 1)) :] if self.window > 1 else window[:0]
        )
        if self.compressor is not None:
            assert state.compressed is not None and undo.compressed is not None
            self.compressor.rewind(state.compressed, undo.compressed, keep)
        if self.indexer is not None:
            assert state.indexer is not None and undo.indexer is not None
            self.indexer.compressor.rewind(state.indexer, undo.indexer, keep)
        state.undo = None

    def _window(
        self, kv: torch.Tensor, positions: torch.Tensor, state: LayerState, boundary: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The raw rows the new queries may see and the mask [T, K] of which each sees; the state
        keeps the last ``window - 1`` rows (and those before ``boundary``)."""
        keys = torch.cat([state.window, kv])
        first = int(positions[0]) - state.window.shape[0]
        if boundary is not None:
            start = max(0, boundary - (self.window - 1) - first) if self.window > 1 else boundary - first
            state.boundary_window = keys[start : boundary - first].clone()
        key_pos = torch.arange(first, first + keys.shape[0], device=kv.device)
        distance = positions[:, None] - key_pos[None, :]
        state.window = keys[max(0, keys.shape[0] - (self.window - 1)) :] if self.window > 1 else keys[:0]
        return keys, (distance >= 0) & (distance < self.window)

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Softmax attention of ``q [T, H, D]`` over the rows of ``keys [K, D]`` (also the values)
        that ``mask [T, K]`` lets each query see, with one sink logit per head in the denominator
        -> [T, H, D]."""
        visible = mask.sum(-1)
        rows = torch.arange(keys.shape[0], device=keys.device).expand_as(mask)
        order = torch.where(mask, rows, keys.shape[0]).sort(-1).values[:, : int(visible.max())]
        indices = torch.where(order < keys.shape[0], order, -1).to(torch.int32)
        out, lse = self.ops.sparse_mla_decode(
            q[None], keys.view(-1, 1, 1, self.head_dim), indices[None], self.head_dim, self.head_dim**-0.5
        )
        kept = torch.sigmoid(lse[0].transpose(0, 1) - self.attn_sink.float())  # 1 / (1 + e^(sink - lse))
        return (out[0].float() * kept[..., None]).to(q.dtype)


def _split_pair(
    pair: tuple[torch.Tensor, torch.Tensor], sizes: list[int]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return list(zip(pair[0].split(sizes), pair[1].split(sizes), strict=True))
