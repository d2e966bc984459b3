"""DeepSeek-V4's hybrid KV cache as cache groups, tensor-free: what a paged pool, the prefix cache,
a PD transfer and a memory plan must agree on (dsinfer/base/kv_spec.py is V3/V3.2's one group).

A group is a kind of entry kept by a set of layers, each entry covering ``tokens_per_entry`` of the
sequence's tokens:

- ``window``: every layer's raw K=V rows (one per token, ``head_dim`` values); only the last
  ``sliding_window - 1`` are ever read again, so a pool frees the pages that fall out of it;
- ``c4`` / ``c128``: the compressed entries of the CSA / HCA layers (one per 4 / 128 tokens);
- ``c4_indexer``: the CSA layers' indexer keys (one per 4 tokens, ``index_head_dim`` values);
- ``state``: each compressing layer's unfinished compressor rows: not paged, one fixed-size slot
  per sequence, snapshotted where a prefix-cache page ends (a hit must restore it there).

Every paged group shares one page geometry: a page covers ``page_tokens`` tokens of the sequence
(so one prefix hash names the same span in every group) and holds ``page_tokens /
tokens_per_entry`` entries of each layer of its group. ``exact_bytes`` is what the model itself
holds (dsinfer/model/v4_state.py ``cache_bytes``); ``paged_bytes`` what a pool of such pages holds.

Open for the engine (issue 39): a prefix hit at a page boundary needs the window's pages before
it still present (a pool that frees them for live sequences must keep them for cached ones, or
the hit is shorter, as SGLang's SWA pool does), and CSA's overlap rows at that boundary (the
pending rows are none there: a page is a multiple of both rates) kept with the page.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dsinfer.base.kv_spec import DTYPE_BYTES
from dsinfer.base.v4_config import CSA, HCA, V4Config

GroupName = Literal["window", "c4", "c128", "c4_indexer"]
V4_PAGE_TOKENS = 256  # tokens a page covers: a multiple of both compression rates (as the peers use)


@dataclass(frozen=True)
class CacheGroup:
    name: GroupName
    layers: tuple[int, ...]
    tokens_per_entry: int
    width: int  # values per entry
    dtype: str

    @property
    def entry_bytes(self) -> int:
        """One entry of one layer."""
        return self.width * DTYPE_BYTES[self.dtype]

    def entries(self, tokens: int) -> int:
        """Entries one layer holds after ``tokens`` tokens (a compressed entry once its block is whole)."""
        return tokens // self.tokens_per_entry


@dataclass(frozen=True)
class HybridCacheSpec:
    groups: tuple[CacheGroup, ...]
    window: int  # raw rows read again: sliding_window - 1
    state_bytes: int  # the compressors' unfinished rows of one sequence at most, every layer
    page_tokens: int = V4_PAGE_TOKENS

    def __post_init__(self) -> None:
        for group in self.groups:
            if self.page_tokens % group.tokens_per_entry:
                raise ValueError(
                    f"page_tokens {self.page_tokens} is not a multiple of group {group.name}'s "
                    f"{group.tokens_per_entry} tokens per entry"
                )

    @classmethod
    def for_v4(
        cls, config: V4Config, dtype: str, page_tokens: int = V4_PAGE_TOKENS, mtp_layers: int = 0
    ) -> HybridCacheSpec:
        """``mtp_layers``: MTP layers served too (their windows, sequence by sequence)."""
        kinds = config.layer_types
        csa = tuple(i for i, k in enumerate(kinds) if k == CSA)
        hca = tuple(i for i, k in enumerate(kinds) if k == HCA)
        groups = [CacheGroup("window", tuple(range(len(kinds) + mtp_layers)), 1, config.head_dim, dtype)]
        if csa:
            rate = config.compress_rates[CSA]
            groups.append(CacheGroup("c4", csa, rate, config.head_dim, dtype))
            groups.append(CacheGroup("c4_indexer", csa, rate, config.index_head_dim, dtype))
        if hca:
            groups.append(CacheGroup("c128", hca, config.compress_rates[HCA], config.head_dim, dtype))
        # the most unfinished rows a compressor holds: rate - 1 rows of kv and gate (CSA's at twice
        # the width, for its overlapping windows) and CSA's overlap, the last window's first half
        csa_rate, hca_rate = config.compress_rates[CSA], config.compress_rates[HCA]
        csa_state = sum(
            2 * (csa_rate - 1) * 2 * dim + 2 * csa_rate * dim
            for dim in (config.head_dim, config.index_head_dim)
        )
        hca_state = 2 * (hca_rate - 1) * config.head_dim
        state = (len(csa) * csa_state + len(hca) * hca_state) * DTYPE_BYTES[dtype]
        return cls(tuple(groups), config.sliding_window - 1, state, page_tokens)

    def group(self, name: GroupName) -> CacheGroup | None:
        return next((g for g in self.groups if g.name == name), None)

    def page_bytes(self, group: CacheGroup) -> int:
        """One page of ``group``: every layer of it, ``page_tokens / tokens_per_entry`` entries each."""
        return len(group.layers) * (self.page_tokens // group.tokens_per_entry) * group.entry_bytes

    def pages(self, group: CacheGroup, tokens: int) -> int:
        """Pages a sequence of ``tokens`` holds in ``group``: the window keeps only the pages that
        still hold one of its last ``window`` rows; a compressed group, its whole entries' pages."""
        if group.name == "window":
            if tokens == 0:
                return 0
            first = max(0, tokens - self.window) // self.page_tokens
            return (tokens - 1) // self.page_tokens - first + 1
        return -(-group.entries(tokens) * group.tokens_per_entry // self.page_tokens)

    @property
    def charged_page_bytes(self) -> int:
        """What one page is charged: its tokens' compressed entries and indexer keys (the window's
        rows are each sequence's bounded part, :attr:`sequence_bytes`)."""
        return sum(self.page_bytes(g) for g in self.groups if g.name != "window")

    @property
    def sequence_bytes(self) -> int:
        """What one sequence holds at most whatever its length: the window's rows of every layer
        and the compressors' unfinished rows."""
        window = self.group("window")
        assert window is not None
        return self.window * len(window.layers) * window.entry_bytes + self.state_bytes

    def reserve_bytes(self, max_num_seqs: int) -> int:
        """Set aside before pages: ``max_num_seqs`` sequences' bounded part and as many resume
        points (each at most a window and the compressors' overlap rows)."""
        return 2 * max_num_seqs * self.sequence_bytes

    def exact_bytes(self, tokens: int) -> dict[str, int]:
        """Bytes the entries themselves take (no page rounding), by group; "state" at most."""
        out = {
            g.name: len(g.layers) * g.entries(tokens) * g.entry_bytes
            for g in self.groups
            if g.name != "window"
        }
        window = self.group("window")
        assert window is not None
        out["window"] = len(window.layers) * min(tokens, self.window) * window.entry_bytes
        return out

    def paged_bytes(self, tokens: int) -> dict[str, int]:
        """Bytes a paged pool holds for a sequence of ``tokens`` tokens, by group, and its state slot."""
        out = {g.name: self.pages(g, tokens) * self.page_bytes(g) for g in self.groups}
        out["state"] = self.state_bytes
        return out
