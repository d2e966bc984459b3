"""What one DeepSeek-V4 sequence keeps per layer between forwards: its hybrid cache.

Each layer holds, for the tokens seen so far:

- ``window``: the raw K=V rows of the last ``sliding_window - 1`` tokens (the next query's window
  is those and itself);
- CSA and HCA layers, a ``Series`` of compressed entries (one per ``compress_rate`` tokens) and the
  compressor state that is not an entry yet: the projected rows of the unfinished window
  (``pending_kv``/``pending_gate``) and, for CSA's overlapping windows, the last finished window's
  first half (``overlap_kv``/``overlap_gate``), which the next entry mixes in;
- CSA layers also the indexer's ``Series`` (its own compressed keys at ``index_head_dim``).

Positions are implicit: the sequence's tokens are 0..n-1 and entry ``e`` covers tokens
``[e * rate, (e + 1) * rate)``. ``nbytes`` counts what each group holds, the figures a cache spec
and a transfer must agree with.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from dsinfer.base.v4_config import CSA, HCA, V4Config


class EntryStore(Protocol):
    """Where a series keeps its compressed entries: whole in one tensor (``DenseEntries``) or in
    the pool's pages (dsinfer/model/v4_paged.py)."""

    def read(self) -> torch.Tensor:
        """Every entry so far, [E, dim]."""
        ...

    def append(self, entries: torch.Tensor) -> None: ...

    def truncate(self, count: int) -> None:
        """Keep the first ``count`` entries."""
        ...

    def __len__(self) -> int: ...

    @property
    def nbytes(self) -> int: ...


class DenseEntries:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def read(self) -> torch.Tensor:
        return self.tensor

    def append(self, entries: torch.Tensor) -> None:
        self.tensor = torch.cat([self.tensor, entries])

    def truncate(self, count: int) -> None:
        self.tensor = self.tensor[:count]

    def __len__(self) -> int:
        return self.tensor.shape[0]

    @property
    def nbytes(self) -> int:
        return self.tensor.nbytes


@dataclass
class Series:
    """Compressed entries of one compressor and its unfinished state."""

    entries: EntryStore  # [E, dim]
    pending_kv: torch.Tensor  # [< rate, width] projected rows of the window not finished yet
    pending_gate: torch.Tensor
    overlap_kv: torch.Tensor | None = None  # CSA: [rate, dim] first half of the last finished window
    overlap_gate: torch.Tensor | None = None
    boundary_overlap: tuple[torch.Tensor, torch.Tensor] | None = None  # CSA: the overlap at ``boundary``

    @classmethod
    def empty(cls, dim: int, width: int, dtype: torch.dtype, device: torch.device) -> Series:
        return cls(
            DenseEntries(torch.empty(0, dim, dtype=dtype, device=device)),
            torch.empty(0, width, dtype=dtype, device=device),
            torch.empty(0, width, dtype=dtype, device=device),
        )

    def state_nbytes(self) -> int:
        parts = [self.pending_kv, self.pending_gate, self.overlap_kv, self.overlap_gate]
        return sum(t.nbytes for t in parts if t is not None)


@dataclass(frozen=True)
class SeriesUndo:
    """A series as a step found it, and the rows the step fed it: enough to take the step's last
    tokens back out (an MTP draft the target rejected)."""

    count: int
    pending_kv: torch.Tensor
    pending_gate: torch.Tensor
    overlap_kv: torch.Tensor | None
    overlap_gate: torch.Tensor | None
    rows: tuple[torch.Tensor, torch.Tensor]  # the step's (kv, gate) rows

    @classmethod
    def before(cls, series: Series, rows: tuple[torch.Tensor, torch.Tensor]) -> SeriesUndo:
        return cls(
            len(series.entries),
            series.pending_kv,
            series.pending_gate,
            series.overlap_kv,
            series.overlap_gate,
            rows,
        )


@dataclass(frozen=True)
class LayerUndo:
    window: torch.Tensor  # the window before the step
    rows: torch.Tensor  # the step's K=V rows
    compressed: SeriesUndo | None = None
    indexer: SeriesUndo | None = None


@dataclass
class LayerState:
    window: torch.Tensor  # [<= sliding_window - 1, head_dim]
    compressed: Series | None = None  # CSA, HCA
    indexer: Series | None = None  # CSA
    boundary_window: torch.Tensor | None = None  # the window's rows before ``boundary``
    undo: LayerUndo | None = None  # kept by a step that verifies an MTP draft


@dataclass
class SequenceState:
    """One sequence's cache over every layer; ``length`` tokens seen.

    With ``boundary_every`` (a page's tokens), a forward that crosses multiples of it records in
    ``boundary`` the last one crossed and, per layer, what a sequence resuming there needs beside
    the pages: the window's rows before it and CSA's overlap rows (no compressor row is pending at
    a multiple of every rate)."""

    layers: list[LayerState]
    length: int = 0
    boundary_every: int | None = None
    boundary: int | None = None

    @classmethod
    def empty(
        cls, config: V4Config, dtype: torch.dtype, device: torch.device | str = "cpu", mtp_layers: int = 0
    ) -> SequenceState:
        """``mtp_layers``: the MTP layers' windows follow the decoder layers' states."""
        device = torch.device(device)
        layers = []
        for kind in [
            *config.layer_types,
            *[config.layer_kind(config.num_hidden_layers + j) for j in range(mtp_layers)],
        ]:
            state = LayerState(torch.empty(0, config.head_dim, dtype=dtype, device=device))
            if kind in (CSA, HCA):
                width = config.head_dim * (2 if kind == CSA else 1)
                state.compressed = Series.empty(config.head_dim, width, dtype, device)
            if kind == CSA:
                state.indexer = Series.empty(config.index_head_dim, 2 * config.index_head_dim, dtype, device)
            layers.append(state)
        return cls(layers)

    def snapshot(self) -> Callable[[], None]:
        """What puts this state back as it is now: a step that fails midway (a peer of an
        expert-parallel pool died in a collective) leaves some layers with its tokens and others
        without. Steps replace the state's parts rather than change them, and write entries only
        past the counts, so shallow copies and the entry counts are enough."""
        kept = copy.copy(self)
        layers = [(layer, copy.copy(layer)) for layer in self.layers]
        series = [
            (s, copy.copy(s), len(s.entries))
            for layer in self.layers
            for s in (layer.compressed, layer.indexer)
            if s is not None
        ]

        def restore() -> None:
            vars(self).update(vars(kept))
            for layer, saved in layers:
                vars(layer).update(vars(saved))
                layer.undo = None
            for s, saved, count in series:
                vars(s).update(vars(saved))
                s.entries.truncate(count)

        return restore

    def nbytes(self) -> dict[str, int]:
        """Bytes held per cache group: the raw window, compressed entries, indexer keys, and the
        compressors' unfinished state."""
        totals = {"window": 0, "compressed": 0, "indexer": 0, "compressor_state": 0}
        for layer in self.layers:
            totals["window"] += layer.window.nbytes
            for name, series in (("compressed", layer.compressed), ("indexer", layer.indexer)):
                if series is not None:
                    totals[name] += series.entries.nbytes
                    totals["compressor_state"] += series.state_nbytes()
        return totals


def cache_bytes(config: V4Config, context: int, value_bytes: int) -> dict[str, int]:
    """What ``SequenceState.nbytes`` says for a sequence of ``context`` tokens, from the config
    alone (values of ``value_bytes`` each): the per-request figures of a memory plan."""
    totals = {"window": 0, "compressed": 0, "indexer": 0, "compressor_state": 0}
    for layer, kind in enumerate(config.layer_types):
        totals["window"] += min(context, config.sliding_window - 1) * config.head_dim * value_bytes
        if kind not in (CSA, HCA):
            continue
        rate = config.compress_rate(layer)
        groups = [(config.head_dim, "compressed")] + (
            [(config.index_head_dim, "indexer")] if kind == CSA else []
        )
        for dim, group in groups:
            totals[group] += (context // rate) * dim * value_bytes
            width = 2 * dim if kind == CSA else dim
            overlap = (
                2 * rate * dim if kind == CSA and context >= rate else 0
            )  # kv and gate of the last block's first half
            totals["compressor_state"] += (2 * (context % rate) * width + overlap) * value_bytes
    return totals


@dataclass(frozen=True)
class Boundary:
    """What a sequence resuming at ``position`` (a page boundary) needs besides its pages."""

    position: int
    windows: list[torch.Tensor]  # per layer
    overlaps: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]  # (layer, series) -> kv, gate

    @classmethod
    def of(cls, state: SequenceState) -> Boundary:
        assert state.boundary is not None
        windows, overlaps = [], {}
        for i, layer in enumerate(state.layers):
            assert layer.boundary_window is not None
            windows.append(layer.boundary_window)
            for name, series in (("compressed", layer.compressed), ("indexer", layer.indexer)):
                if series is not None and series.boundary_overlap is not None:
                    overlaps[(i, name)] = series.boundary_overlap
        return cls(state.boundary, windows, overlaps)
