"""What one forward step is told about its tokens and where their latent KV lives.

Tokens of all sequences are flattened into one dimension T (sequence after sequence). Sequence i
contributes ``q_lens[i]`` new tokens, whose latent KV is written at ``slot_mapping`` (a flat slot
``page * page_size + offset`` in every layer's cache), and then attends to ``kv_lens[i]`` cached
tokens (its prefix plus the new ones), found through row i of ``block_tables``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch


class MLAPath(str, Enum):
    """Which of MLA's two mathematically equal computations a step uses."""

    DECOMPRESSED = "decompressed"  # per-head K/V from kv_b_proj: cheaper when many queries share a context
    ABSORBED = "absorbed"  # attention in the latent space over the paged cache (FlashMLA's form)


@dataclass
class ForwardBatch:
    positions: torch.Tensor  # int64 [T]: position of each new token in its sequence
    slot_mapping: torch.Tensor  # int64 [T]: cache slot receiving each new token's latent
    block_tables: torch.Tensor  # int32 [B, max_pages]: page ids of each sequence, padded with 0
    q_lens: list[int]  # new tokens per sequence
    kv_lens: list[int]  # cached tokens per sequence after this step (prefix + new)
    mla_path: MLAPath = MLAPath.DECOMPRESSED

    def __post_init__(self) -> None:
        if len(self.q_lens) != len(self.kv_lens):
            raise ValueError("q_lens and kv_lens must have one entry per sequence")
        if any(q > kv for q, kv in zip(self.q_lens, self.kv_lens, strict=True)):
            raise ValueError("a sequence cannot have more new tokens than cached tokens")
        if self.mla_path is MLAPath.ABSORBED and len(set(self.q_lens)) > 1:
            raise ValueError("the absorbed MLA path needs the same number of new tokens in every sequence")

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)

    def last_token_indices(self) -> torch.Tensor:
        """Index into T of each sequence's last new token (where the next token is predicted)."""
        ends = torch.tensor(self.q_lens, dtype=torch.int64).cumsum(0) - 1
        return ends.to(self.positions.device)

    def cache_seqlens(self) -> torch.Tensor:
        return torch.tensor(self.kv_lens, dtype=torch.int32, device=self.block_tables.device)
