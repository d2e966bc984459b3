"""The caches of the DeepSeek-V4 sequences an engine serves: compressed entries in pages, the rest
per sequence.

The groups that grow with a sequence's tokens live in the pool's pages (dsinfer/base/kv_groups.py):
per compressing layer a tensor ``[num_pages, page_tokens / rate, dim]`` of its compressed entries
(and, CSA, one of its indexer keys), entry ``e`` of a sequence in slot ``e % per_page`` of page
``pages[e // per_page]``. What stays bounded whatever the length, the window's last rows and the
compressors' unfinished rows, is the sequence's ``SequenceState`` kept here under its key (its
request and choice), its series' entries bound to its pages before each step. The engine keeps
the states of the sequences that run and drops the others (``keep``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from dsinfer.base.v4_config import CSA, HCA, V4Config
from dsinfer.model.v4_state import SequenceState, Series


class PagedEntries:
    """A series' entries in ``pool [num_pages, per_page, dim]``, over the sequence's ``pages``."""

    def __init__(self, pool: torch.Tensor, count: int = 0) -> None:
        self.pool, self.count = pool, count
        self.pages: list[int] = []

    def read(self) -> torch.Tensor:
        per_page = self.pool.shape[1]
        used = -(-self.count // per_page)
        pages = torch.tensor(self.pages[:used], dtype=torch.long, device=self.pool.device)
        return self.pool.index_select(0, pages).view(-1, self.pool.shape[2])[: self.count]

    def append(self, entries: torch.Tensor) -> None:
        per_page = self.pool.shape[1]
        index = torch.arange(self.count, self.count + entries.shape[0])
        if int(index[-1]) // per_page >= len(self.pages):
            raise RuntimeError(f"entry {int(index[-1])} falls past the sequence's {len(self.pages)} pages")
        pages = torch.tensor(self.pages, dtype=torch.long)[index // per_page]
        slots = (pages * per_page + index % per_page).to(self.pool.device)
        self.pool.view(-1, self.pool.shape[2])[slots] = entries.to(self.pool.dtype)
        self.count += entries.shape[0]

    def __len__(self) -> int:
        return self.count

    @property
    def nbytes(self) -> int:
        return self.count * self.pool.shape[2] * self.pool.element_size()


class SequenceStates:
    """Every served sequence's V4 cache: the pages' compressed groups and the sequences' states."""

    def __init__(
        self,
        config: V4Config,
        num_pages: int,
        page_tokens: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.config, self.dtype, self.device, self.page_tokens = config, dtype, device, page_tokens
        self.groups: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}  # layer -> entries, indexer
        for layer, kind in enumerate(config.layer_types):
            if kind not in (CSA, HCA):
                continue
            per_page = page_tokens // config.compress_rate(layer)
            entries = torch.zeros(num_pages, per_page, config.head_dim, dtype=dtype, device=device)
            indexer = (
                torch.zeros(num_pages, per_page, config.index_head_dim, dtype=dtype, device=device)
                if kind == CSA
                else None
            )
            self.groups[layer] = (entries, indexer)
        self._states: dict[str, SequenceState] = {}

    def tensors(self) -> list[torch.Tensor]:
        """The paged groups' tensors, layer by layer (entries, then indexer keys)."""
        return [t for pair in self.groups.values() for t in pair if t is not None]

    def for_step(self, key: str, start: int, pages: list[int]) -> SequenceState:
        """The state of the sequence ``key`` whose step computes from position ``start`` over
        ``pages``: a new one at 0 (a prompt's first chunk, or a sequence computed again)."""
        if start == 0:
            self._states[key] = self._new_state()
        state = self._states.get(key)
        if state is None or state.length != start:
            held = "none" if state is None else f"{state.length} tokens"
            raise RuntimeError(f"V4 cache of sequence {key}: step from {start}, state holds {held}")
        for layer in state.layers:
            for series in (layer.compressed, layer.indexer):
                if series is not None:
                    assert isinstance(series.entries, PagedEntries)
                    series.entries.pages = pages
        return state

    def _new_state(self) -> SequenceState:
        state = SequenceState.empty(self.config, self.dtype, self.device)
        for layer, (entries, indexer) in self.groups.items():
            paged = state.layers[layer]
            assert paged.compressed is not None
            paged.compressed = _paged(paged.compressed, entries)
            if indexer is not None:
                assert paged.indexer is not None
                paged.indexer = _paged(paged.indexer, indexer)
        return state

    def keep(self, keys: Iterable[str]) -> None:
        """Drop the states of every sequence but ``keys`` (those still running)."""
        wanted = set(keys)
        for key in [k for k in self._states if k not in wanted]:
            del self._states[key]

    def __len__(self) -> int:
        return len(self._states)

    def nbytes(self) -> dict[str, int]:
        """Bytes held per cache group over every live sequence (entries: those written)."""
        totals = {"window": 0, "compressed": 0, "indexer": 0, "compressor_state": 0}
        for state in self._states.values():
            for group, n in state.nbytes().items():
                totals[group] += n
        return totals


def _paged(series: Series, pool: torch.Tensor) -> Series:
    series.entries = PagedEntries(pool)
    return series
