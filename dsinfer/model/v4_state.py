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

from dataclasses import dataclass

import torch

from dsinfer.base.v4_config import CSA, HCA, V4Config


@dataclass
class Series:
    """Compressed entries of one compressor and its unfinished state."""

    entries: torch.Tensor  # [E, dim]
    pending_kv: torch.Tensor  # [< rate, width] projected rows of the window not finished yet
    pending_gate: torch.Tensor
    overlap_kv: torch.Tensor | None = None  # CSA: [rate, dim] first half of the last finished window
    overlap_gate: torch.Tensor | None = None

    @classmethod
    def empty(cls, dim: int, width: int, dtype: torch.dtype, device: torch.device) -> Series:
        return cls(
            torch.empty(0, dim, dtype=dtype, device=device),
            torch.empty(0, width, dtype=dtype, device=device),
            torch.empty(0, width, dtype=dtype, device=device),
        )

    def state_nbytes(self) -> int:
        parts = [self.pending_kv, self.pending_gate, self.overlap_kv, self.overlap_gate]
        return sum(t.nbytes for t in parts if t is not None)


@dataclass
class LayerState:
    window: torch.Tensor  # [<= sliding_window - 1, head_dim]
    compressed: Series | None = None  # CSA, HCA
    indexer: Series | None = None  # CSA


@dataclass
class SequenceState:
    """One sequence's cache over every layer; ``length`` tokens seen."""

    layers: list[LayerState]
    length: int = 0

    @classmethod
    def empty(cls, config: V4Config, dtype: torch.dtype, device: torch.device | str = "cpu") -> SequenceState:
        device = torch.device(device)
        layers = []
        for kind in config.layer_types:
            state = LayerState(torch.empty(0, config.head_dim, dtype=dtype, device=device))
            if kind in (CSA, HCA):
                width = config.head_dim * (2 if kind == CSA else 1)
                state.compressed = Series.empty(config.head_dim, width, dtype, device)
            if kind == CSA:
                state.indexer = Series.empty(config.index_head_dim, 2 * config.index_head_dim, dtype, device)
            layers.append(state)
        return cls(layers)

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


class SequenceStates:
    """The hybrid caches of the sequences an engine runs, each kept under its ``key``: the first
    page of its block table, a page no other live sequence holds (V4 pages are not shared: no
    prefix cache yet). The pool that owns the pages drops a key's state when that page is freed,
    so a finished, aborted or preempted sequence leaves nothing behind."""

    def __init__(self, config: V4Config, dtype: torch.dtype, device: torch.device) -> None:
        self.config, self.dtype, self.device = config, dtype, device
        self._states: dict[int, SequenceState] = {}

    def for_step(self, key: int, start: int) -> SequenceState:
        """The state of the sequence keyed ``key`` whose step computes from position ``start``: a
        new one at 0 (a prompt's first chunk, or a preempted sequence computed again)."""
        if start == 0:
            self._states[key] = SequenceState.empty(self.config, self.dtype, self.device)
        state = self._states.get(key)
        if state is None or state.length != start:
            held = "none" if state is None else f"{state.length} tokens"
            raise RuntimeError(
                f"V4 cache of the sequence at page {key}: step from {start}, state holds {held}"
            )
        return state

    def drop(self, pages: list[int]) -> None:
        for page in pages:
            self._states.pop(page, None)

    def __len__(self) -> int:
        return len(self._states)

    def nbytes(self) -> dict[str, int]:
        """Bytes held per cache group over every live sequence."""
        totals = {"window": 0, "compressed": 0, "indexer": 0, "compressor_state": 0}
        for state in self._states.values():
            for group, n in state.nbytes().items():
                totals[group] += n
        return totals
