"""DeepSeek-V4's token compressors and the lightning indexer over compressed keys.

A compressor turns every ``rate`` source tokens into one entry: the projected rows ``C = x Wkv``
weighted by ``softmax(x Wgate + ape)`` over the window, summed, RMS-normed and rotated at the
window's first position. CSA's windows overlap: ``Wkv``/``Wgate`` emit two series of ``dim``
channels, and entry ``e`` mixes the first series of window ``e - 1`` with the second of window
``e`` (``2 * rate`` rows; window 0 has no predecessor). HCA's windows do not overlap.

A query at position ``t`` may see entry ``e`` once its window is complete: ``e < (t + 1) // rate``.
The indexer keeps each query's ``index_topk`` entries by ``sum_h w_h * relu(q_h . k)`` (its own
compressor at ``index_head_dim``); picks beyond what the query may see are ``-1``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from dsinfer.base.v4_config import V4Config
from dsinfer.model.layers import Linear, RotaryEmbedding
from dsinfer.model.v4_paged import PagedEntries
from dsinfer.model.v4_state import Series, SeriesUndo
from dsinfer.ops import Ops


class V4RMSNorm(nn.Module):
    """RMSNorm whose float32 weight multiplies before the cast back (V4 keeps norms in fp32)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (self.weight.float() * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps))).to(
            x.dtype
        )


def rotate(
    rope: RotaryEmbedding, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False
) -> torch.Tensor:
    """RoPE on the trailing channels of ``x [T, ..., D]`` at ``positions [T]`` (``inverse``: by
    minus the angle): cos and sin rounded to ``x``'s dtype, the rotation in float32."""
    cos, sin = (t.float() for t in rope.cos_sin(positions, x.dtype))
    dim = cos.shape[-1]
    rotated = rope(x[..., -dim:].float(), (cos, -sin if inverse else sin)).to(x.dtype)
    return torch.cat([x[..., :-dim], rotated], dim=-1)


class Compressor(nn.Module):
    def __init__(self, config: V4Config, ops: Ops, rate: int, dim: int, overlap: bool) -> None:
        super().__init__()
        self.rate, self.dim, self.overlap, self.ops = rate, dim, overlap, ops
        width = dim * (2 if overlap else 1)
        self.wkv = Linear(config.hidden_size, width, ops)
        self.wgate = Linear(config.hidden_size, width, ops)
        self.ape = nn.Parameter(torch.zeros(rate, width), requires_grad=False)
        self.norm = V4RMSNorm(dim, config.rms_norm_eps)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, hidden]`` (any sequences' tokens) -> their (kv, gate) rows [T, width]."""
        return self.wkv(x), self.wgate(x)

    def compress(
        self,
        rows: tuple[torch.Tensor, torch.Tensor],
        series: Series,
        rope: RotaryEmbedding,
        boundary: int | None = None,
    ) -> None:
        """Feed one sequence's next tokens' ``project`` rows; the windows they complete become
        entries of ``series``, the rest stays pending (CSA: the overlap at ``boundary`` is kept)."""
        kv = torch.cat([series.pending_kv, rows[0]])
        gate = torch.cat([series.pending_gate, rows[1]])
        windows = kv.shape[0] // self.rate
        usable = windows * self.rate
        series.pending_kv, series.pending_gate = kv[usable:], gate[usable:]
        if windows == 0:
            return
        kv = kv[:usable].view(windows, self.rate, -1)
        gate = gate[:usable].view(windows, self.rate, -1) + self.ape.to(gate.dtype)
        if self.overlap:
            if boundary is not None:  # the window ending at the boundary is one of these
                at = boundary // self.rate - 1 - len(series.entries)
                series.boundary_overlap = (kv[at, :, : self.dim].clone(), gate[at, :, : self.dim].clone())
            kv, gate = self._overlapped(kv, gate, series)
        entries = self.norm(self.ops.pool_windows(kv, gate))
        first = len(series.entries)
        positions = (torch.arange(windows, device=kv.device) + first) * self.rate
        series.entries.append(rotate(rope, entries, positions))

    def rewind(self, series: Series, undo: SeriesUndo, keep: int) -> None:
        """``series`` back to what ``undo`` found plus only the step's first ``keep`` rows. The
        entries those rows completed are among the step's own (the same rows gave them), so only
        counts and the unfinished rows change; CSA's overlap is the last completed window's."""
        kv = torch.cat([undo.pending_kv, undo.rows[0][:keep]])
        gate = torch.cat([undo.pending_gate, undo.rows[1][:keep]])
        windows = kv.shape[0] // self.rate
        usable = windows * self.rate
        series.pending_kv, series.pending_gate = kv[usable:], gate[usable:]
        series.entries.truncate(undo.count + windows)
        if not self.overlap:
            return
        if windows == 0:
            series.overlap_kv, series.overlap_gate = undo.overlap_kv, undo.overlap_gate
            return
        last = slice(usable - self.rate, usable)
        series.overlap_kv = kv[last, : self.dim].clone()
        series.overlap_gate = (gate[last] + self.ape.to(gate.dtype))[:, : self.dim].clone()

    def _overlapped(
        self, kv: torch.Tensor, gate: torch.Tensor, series: Series
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[W, rate, 2 dim] -> [W, 2 rate, dim]: window w's rows are window w-1's first series and
        its own second series (an absent predecessor weighs nothing)."""
        windows, rate, dim = kv.shape[0], self.rate, self.dim
        mixed_kv = kv.new_zeros(windows, 2 * rate, dim)
        mixed_gate = gate.new_full((windows, 2 * rate, dim), float("-inf"))
        mixed_kv[:, rate:], mixed_gate[:, rate:] = kv[..., dim:], gate[..., dim:]
        mixed_kv[1:, :rate], mixed_gate[1:, :rate] = kv[:-1, :, :dim], gate[:-1, :, :dim]
        if series.overlap_kv is not None and series.overlap_gate is not None:
            mixed_kv[0, :rate], mixed_gate[0, :rate] = series.overlap_kv, series.overlap_gate
        series.overlap_kv, series.overlap_gate = kv[-1, :, :dim].clone(), gate[-1, :, :dim].clone()
        return mixed_kv, mixed_gate


def visible_entries(positions: torch.Tensor, rate: int) -> torch.Tensor:
    """How many entries each query at ``positions [T]`` may see: those whose window is complete."""
    return (positions + 1) // rate


class Indexer(nn.Module):
    def __init__(self, config: V4Config, ops: Ops, rate: int) -> None:
        super().__init__()
        self.heads, self.dim, self.topk, self.rate = (
            config.index_n_heads,
            config.index_head_dim,
            config.index_topk,
            rate,
        )
        self.compressor = Compressor(config, ops, rate, self.dim, overlap=True)
        self.wq_b = Linear(config.q_lora_rank, self.heads * self.dim, ops)
        self.weights_proj = Linear(config.hidden_size, self.heads, ops)
        # a kernel backend scores the entries through ``ops.indexer_topk`` (V3.2's lightning
        # indexer over the entries' pages); the torch reference keeps transformers' order of sums
        self.ops = ops if ops.backends.get("indexer", "torch") != "torch" else None

    def project(
        self, x: torch.Tensor, q_lora: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding
    ) -> IndexerRows:
        """Any sequences' next tokens ``x [T, hidden]`` at ``positions [T]`` -> their rows."""
        q = rotate(rope, self.wq_b(q_lora).view(x.shape[0], self.heads, self.dim), positions)
        weights = self.weights_proj(x).float() * self.heads**-0.5  # [T, heads]
        return IndexerRows(*self.compressor.project(x), q, weights)

    def select(
        self,
        rows: IndexerRows,
        positions: torch.Tensor,
        series: Series,
        rope: RotaryEmbedding,
        boundary: int | None = None,
    ) -> torch.Tensor:
        """One sequence's entries each query attends to [T, min(topk, E)], -1 where it may see
        fewer; its indexer keys take the tokens in first."""
        self.compressor.compress((rows.kv, rows.gate), series, rope, boundary)
        if self.ops is not None:
            return self._select_by_kernel(rows, positions, series)
        keys = series.entries.read().float()  # [E, d]
        scores = torch.einsum("thd,ed->the", rows.q.float(), keys).relu() * self.dim**-0.5
        index_scores = torch.einsum("the,th->te", scores, rows.weights)
        visible = visible_entries(positions, self.rate)[:, None]
        entry = torch.arange(keys.shape[0], device=keys.device)[None, :]
        index_scores = index_scores.masked_fill(entry >= visible, float("-inf"))
        picks = index_scores.topk(min(self.topk, keys.shape[0]), dim=-1).indices
        return torch.where(picks >= visible, torch.full_like(picks, -1), picks)

    def _select_by_kernel(self, rows: IndexerRows, positions: torch.Tensor, series: Series) -> torch.Tensor:
        """``select`` through ``ops.indexer_topk``: each query is a sequence of one token whose
        keys are the entries it may see, read from their pages (or from one page: dense)."""
        assert self.ops is not None
        entries, tokens = series.entries, positions.shape[0]
        if len(entries) == 0:
            return torch.full((tokens, 0), -1, dtype=torch.long, device=positions.device)
        if isinstance(entries, PagedEntries):
            used = -(-len(entries) // entries.pool.shape[1])
            cache, table = entries.pool, torch.tensor(entries.pages[:used], dtype=torch.int32)
        else:
            keys = entries.read()
            cache, table = keys.view(1, keys.shape[0], keys.shape[1]), torch.zeros(1, dtype=torch.int32)
        device = cache.device
        picks = self.ops.indexer_topk(
            rows.q[:, None].to(cache.dtype),
            (rows.weights * self.dim**-0.5)[:, None],
            cache,
            table.to(device).expand(tokens, -1).contiguous(),
            visible_entries(positions, self.rate).to(torch.int32),
            self.topk,
        )
        return picks[:, 0].long()


class IndexerRows(NamedTuple):
    """Per token: the indexer's compressor rows, its rotated queries [T, heads, dim] and head
    weights [T, heads]."""

    kv: torch.Tensor
    gate: torch.Tensor
    q: torch.Tensor
    weights: torch.Tensor

    def split(self, sizes: list[int]) -> list[IndexerRows]:
        return [IndexerRows(*parts) for parts in zip(*(t.split(sizes) for t in self), strict=True)]


def entry_mask(
    positions: torch.Tensor, num_entries: int, rate: int, picks: torch.Tensor | None
) -> torch.Tensor:
    """[T, E] True where a query attends to an entry: complete, and (CSA) picked by the indexer."""
    entry = torch.arange(num_entries, device=positions.device)[None, :]
    allowed = entry < visible_entries(positions, rate)[:, None]
    if picks is None:
        return allowed
    chosen = torch.zeros(positions.shape[0], num_entries + 1, dtype=torch.bool, device=positions.device)
    chosen.scatter_(1, torch.where(picks >= 0, picks, num_entries), True)
    return allowed & chosen[:, :num_entries]
