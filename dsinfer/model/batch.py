"""What one forward step is told about its tokens and where their KV lives.

Tokens of all sequences are flattened into one dimension T (sequence after sequence). Sequence i
contributes ``q_lens[i]`` new tokens, whose latent KV is written at ``slot_mapping`` (a flat slot
``page * page_size + offset`` in every layer's cache), and then attends to ``kv_lens[i]`` cached
tokens (its prefix plus the new ones), found through row i of ``block_tables``.

Per-step device tensors that every layer reads (``cache_seqlens`` of the absorbed sequences) are
built once here, never per layer. A batch replayed from a CUDA graph (dsinfer/engine/cuda_graph.py)
is built over static buffers instead: ``cache_seqlens`` and ``token_mask`` are given as device
tensors (their values change between replays, the host lists do not), padding rows are marked
False in ``token_mask``, and ``masked_moe`` sends the routed experts through the masked layout,
which needs no host synchronisation.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from dsinfer.model.layers import RotaryEmbedding


@dataclass(frozen=True)
class LayerCache:
    """One layer's per-token caches (dsinfer/base/kv_spec.py), each ``[num_pages, page_size,
    width]`` over the same pages: MLA's latent and, in sparse-attention models, the indexer keys."""

    latent: torch.Tensor
    indexer: torch.Tensor | None = None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The caches present, in the spec's order."""
        return (self.latent,) if self.indexer is None else (self.latent, self.indexer)


@dataclass
class ForwardBatch:
    """MLA runs two mathematically equal paths: the first ``B - num_absorbed`` sequences (prefill
    chunks, any lengths) the decompressed one, the last ``num_absorbed`` (decodes: one new token, or
    a few with MTP drafts) the absorbed one over the paged cache (FlashMLA's form). That path takes
    one query length: sequences with fewer new tokens than the longest are left-padded to it
    (``absorbed_padding``)."""

    positions: torch.Tensor  # int64 [T]: position of each new token in its sequence
    slot_mapping: torch.Tensor  # int64 [T]: cache slot receiving each new token's latent
    block_tables: torch.Tensor  # int32 [B, max_pages]: page ids of each sequence, padded with 0
    q_lens: list[int]  # new tokens per sequence
    kv_lens: list[int]  # cached tokens per sequence after this step (prefix + new)
    num_absorbed: int = 0
    after_layer: Callable[[int], None] | None = None  # called with each cache layer's index once written
    # int32 [num_absorbed]: cached tokens of each absorbed sequence (FlashMLA's cache_seqlens); built
    # from kv_lens when not given. Given (a static buffer), it wins over kv_lens, which then only
    # hold placeholders for the absorbed sequences.
    cache_seqlens: torch.Tensor | None = None
    token_mask: torch.Tensor | None = None  # bool [T]: False on padding rows (no expert load, no experts)
    masked_moe: bool = False  # routed experts in the masked layout (graph-safe; no host sync)
    seq_keys: list[str] | None = (
        None  # each sequence's identity, for models that keep state per sequence (V4)
    )
    drafts: list[int] | None = (
        None  # each sequence's MTP draft tokens among its new ones (V4 takes them back)
    )
    _rope: dict[tuple[torch.dtype, bool], tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, repr=False
    )
    # (gather, keep) when the absorbed sequences' new tokens differ in number, else None: gather
    # [num_absorbed * S] takes the absorbed tokens' rows into S rows per sequence, left-padded with
    # its first token's row (a padding query's output is never read); keep [absorbed tokens] finds
    # each real token among those rows. Built once per step, read by every layer.
    absorbed_padding: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, init=False, repr=False)

    def rope_cos_sin(self, rotary: RotaryEmbedding, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``rotary.cos_sin`` of ``positions``, computed by the first layer that asks and reused by
        the others: every layer of a model shares one RoPE configuration, in one layout per
        ``interleaved`` (V3.2's MLA rotates pairs, its indexer halves)."""
        key = (dtype, rotary.interleaved)
        if key not in self._rope:
            self._rope[key] = rotary.cos_sin(self.positions, dtype)
        return self._rope[key]

    def __post_init__(self) -> None:
        if len(self.q_lens) != len(self.kv_lens):
            raise ValueError("q_lens and kv_lens must have one entry per sequence")
        if any(q > kv for q, kv in zip(self.q_lens, self.kv_lens, strict=True)):
            raise ValueError("a sequence cannot have more new tokens than cached tokens")
        if not 0 <= self.num_absorbed <= len(self.q_lens):
            raise ValueError("num_absorbed must be between 0 and the number of sequences")
        absorbed_lens = self.q_lens[self.num_decompressed :]
        if len(set(absorbed_lens)) > 1:
            self.absorbed_padding = _left_padding(absorbed_lens, self.positions.device)
        if self.cache_seqlens is None and self.num_absorbed:
            self.cache_seqlens = torch.tensor(
                self.kv_lens[self.num_decompressed :], dtype=torch.int32, device=self.positions.device
            )

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)

    @property
    def num_decompressed(self) -> int:
        return len(self.q_lens) - self.num_absorbed

    @property
    def num_decompressed_tokens(self) -> int:
        return sum(self.q_lens[: self.num_decompressed])

    def last_tokens(self, last: torch.Tensor) -> ForwardBatch:
        """Each sequence's last new token alone (``last``: ``last_token_indices()``), all on the
        absorbed path: attention after this batch's KV is written, for rows whose other tokens'
        outputs nobody reads."""
        return ForwardBatch(
            positions=self.positions[last],
            slot_mapping=self.slot_mapping[last],
            block_tables=self.block_tables,
            q_lens=[1] * self.num_seqs,
            kv_lens=list(self.kv_lens),
            num_absorbed=self.num_seqs,
            # a step of decodes only has every sequence's cached length already
            cache_seqlens=self.cache_seqlens if self.num_absorbed == self.num_seqs else None,
            seq_keys=self.seq_keys,
        )

    def last_token_indices(self) -> torch.Tensor:
        """Index into T of each sequence's last new token (where the next token is predicted)."""
        ends = [end - 1 for end in itertools.accumulate(self.q_lens)]
        return torch.tensor(ends, dtype=torch.int64, device=self.positions.device)


def _left_padding(lens: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``ForwardBatch.absorbed_padding`` of sequences with ``lens`` new tokens each."""
    width, first = max(lens), 0
    gather: list[int] = []
    keep: list[int] = []
    for seq, n in enumerate(lens):
        pad = width - n
        gather += [first] * pad + list(range(first, first + n))
        keep += range(seq * width + pad, (seq + 1) * width)
        first += n
    return torch.tensor(gather, device=device), torch.tensor(keep, device=device)
