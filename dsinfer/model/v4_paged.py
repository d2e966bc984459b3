"""The caches of the DeepSeek-V4 sequences an engine serves: compressed entries in pages, the rest
per sequence.

The groups that grow with a sequence's tokens live in the pool's pages (dsinfer/base/kv_groups.py):
per compressing layer a tensor ``[num_pages, page_tokens / rate, dim]`` of its compressed entries
(and, CSA, one of its indexer keys), entry ``e`` of a sequence in slot ``e % per_page`` of page
``pages[e // per_page]``. What stays bounded whatever the length, the window's last rows and the
compressors' unfinished rows, is the sequence's ``SequenceState`` kept here under its key (its
request and choice), its series' entries bound to its pages before each step. The engine keeps
the states of the sequences that run and drops the others (``keep``).

Prefix caching: a sequence resuming after a cached page finds the compressed groups in the shared
pages, but its window rows and CSA's overlap rows there are nobody's any more. So the state at a
page's end (``Boundary``) is kept as that page's resume point: after each step, for the last page
boundary each sequence crossed in it (``stash``, before the step's pages are committed and written
behind, so that a page's record carries its point); at most ``max_resume_points``, least recently
used first out, and forgotten when the page gets a new owner. A prefix hit is cut back to its last
page with a resume point (``resumable``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

import torch

from dsinfer.base.v4_config import CSA, HCA, V4Config
from dsinfer.model.v4_state import Boundary, SequenceState, Series


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

    def truncate(self, count: int) -> None:
        self.count = min(self.count, count)  # the slots past it are written again

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
        max_resume_points: int = 0,
        mtp_layers: int = 0,
    ) -> None:
        """``mtp_layers``: the MTP layers' windows follow the decoder layers' in every state and
        resume point."""
        self.config, self.dtype, self.device, self.page_tokens = config, dtype, device, page_tokens
        self.mtp_layers = mtp_layers
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
        self._resume: OrderedDict[int, Boundary] = OrderedDict()  # page -> the state at its end; LRU
        self._handed: dict[int, Boundary] = {}  # points a prefill rank handed over, kept until used
        self.max_resume_points = max_resume_points

    def tensors(self) -> list[torch.Tensor]:
        """The paged groups' tensors, layer by layer (entries, then indexer keys)."""
        return [t for pair in self.groups.values() for t in pair if t is not None]

    def for_step(self, key: str, start: int, pages: list[int]) -> SequenceState:
        """The state of the sequence ``key`` whose step computes from position ``start`` over
        ``pages``: a new one at 0 (a prompt's first chunk, or a sequence computed again)."""
        state = self._states.get(key)
        if start == 0:
            state = self._states[key] = self._new_state()
        elif state is None or state.length != start:  # a prefix-cache hit: resume at its last page
            state = self._states[key] = self._resumed(pages[start // self.page_tokens - 1], start)
        for layer in state.layers:
            for series in (layer.compressed, layer.indexer):
                if series is not None:
                    assert isinstance(series.entries, PagedEntries)
                    series.entries.pages = pages
        return state

    def checkpoint(self, keys: Iterable[str]) -> Callable[[], None]:
        """What puts the states of the sequences ``keys`` back as they are now (a new one's
        removed): a step that failed midway is planned again from there."""
        wanted = set(keys)
        present = {key: self._states[key] for key in wanted if key in self._states}
        restores = [state.snapshot() for state in present.values()]

        def restore() -> None:
            for key in [k for k in self._states if k in wanted and k not in present]:
                del self._states[key]
            self._states.update(present)
            for undo in restores:
                undo()

        return restore

    def state_of(self, key: str) -> SequenceState:
        """The state of a sequence that ran this step."""
        return self._states[key]

    def _resumed(self, page: int, start: int) -> SequenceState:
        point = self._handed.pop(page, None)
        if point is not None:
            self.install(page, point)  # a point like any other from now on (the prefix cache's)
        elif (point := self._resume.get(page)) is not None:
            self._resume.move_to_end(page)
        if point is None or point.position != start:
            raise RuntimeError(f"V4: no state to resume at token {start} (page {page})")
        state = self._new_state()
        state.length = start
        for i, layer in enumerate(state.layers):
            layer.window = point.windows[i]
            rate = self.config.compress_rate(i)
            for name, series in (("compressed", layer.compressed), ("indexer", layer.indexer)):
                if series is None:
                    continue
                assert isinstance(series.entries, PagedEntries)
                series.entries.count = start // rate
                series.overlap_kv, series.overlap_gate = point.overlaps.get((i, name), (None, None))
        return state

    # Resume points: the state at the end of a cached page ---------------------------------------
    def stash(self, key: str, pages: list[int]) -> None:
        """Keep the resume point the sequence ``key`` crossed last in its step (if any), before
        the step's pages are committed to the prefix cache (and written behind to disk with it);
        the least recently used beyond ``max_resume_points`` go."""
        state = self._states.get(key)
        if state is None or state.boundary is None:
            return
        self.install(pages[state.boundary // self.page_tokens - 1], Boundary.of(state))
        state.boundary = None

    def resume_point(self, page: int) -> Boundary | None:
        return self._resume.get(page)

    def install(self, page: int, point: Boundary) -> None:
        """A resume point read back for ``page`` (the disk tier)."""
        if self.max_resume_points == 0:
            return
        self._resume[page] = point
        self._resume.move_to_end(page)
        while len(self._resume) > self.max_resume_points:
            self._resume.popitem(last=False)

    def resume_shapes(self) -> list[torch.Tensor]:
        """Zero tensors shaped as a resume point's parts (``resume_shapes``)."""
        return resume_shapes(self.config, self.dtype, self.mtp_layers)

    def boundary_from(self, position: int, parts: list[torch.Tensor]) -> Boundary:
        """The resume point whose parts (``resume_shapes`` order) are ``parts``."""
        c = self.config
        layers = len(c.layer_types) + self.mtp_layers
        windows, rest = parts[:layers], iter(parts[layers:])
        overlaps = {}
        for layer, kind in enumerate(c.layer_types):
            if kind == CSA:
                for name in ("compressed", "indexer"):
                    overlaps[(layer, name)] = (next(rest), next(rest))
        return Boundary(position, windows, overlaps)

    def resumable(self, page: int) -> bool:
        """Whether a sequence can resume after ``page`` (a prefix hit may end there)."""
        return page in self._resume or page in self._handed

    def hand_over(self, page: int, point: Boundary) -> None:
        """The point a prefill rank handed over for ``page``: kept, whatever the LRU does,
        until the sequence resumes there (or the page gets a new owner)."""
        self._handed[page] = point

    def forget(self, pages: list[int]) -> None:
        """``pages`` have new owners: their resume points no longer hold."""
        for page in pages:
            self._resume.pop(page, None)
            self._handed.pop(page, None)

    def _new_state(self) -> SequenceState:
        state = SequenceState.empty(self.config, self.dtype, self.device, self.mtp_layers)
        state.boundary_every = self.page_tokens
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


def resume_shapes(config: V4Config, dtype: torch.dtype, mtp_layers: int = 0) -> list[torch.Tensor]:
    """Zero tensors shaped as a resume point's parts, in ``Boundary`` order: every layer's window
    rows (the MTP layers' after the decoder layers'), then each CSA series' overlap (kv, gate)."""
    rows = max(config.sliding_window - 1, 0)
    layers = len(config.layer_types) + mtp_layers
    parts = [torch.zeros(rows, config.head_dim, dtype=dtype) for _ in range(layers)]
    for layer, kind in enumerate(config.layer_types):
        if kind == CSA:
            rate = config.compress_rate(layer)
            for dim in (config.head_dim, config.index_head_dim):
                parts += [torch.zeros(rate, dim, dtype=dtype), torch.zeros(rate, dim, dtype=dtype)]
    return parts


def _paged(series: Series, pool: torch.Tensor) -> Series:
    series.entries = PagedEntries(pool)
    return series
