"""Online expert staging: new routed-experts modules built piece by piece from the weights a
model was loaded from (checkpoint or dummy), bit-identical to what ``load_model`` loads."""

from __future__ import annotations

import math
from collections import defaultdict, deque
from dataclasses import dataclass
from pathlib import Path

import torch

from dsinfer.base.config import FP8_BLOCK, ModelConfig
from dsinfer.model import checkpoint
from dsinfer.model.moe import Experts
from dsinfer.ops import Ops
from dsinfer.ops.fp8 import dequantize_weight_128x128, quantize_weight_128x128

PIECE_BYTES = 2 << 20  # the most one expert-staging piece writes (whole 128-row blocks, at least one)


@dataclass
class ExpertSource:
    """Builds routed-experts modules holding given logical experts, from the same weights the
    model was loaded from (checkpoint or dummy): what an expert placement change stages."""

    config: ModelConfig
    ops: Ops
    index: dict[str, Path]
    fp8: bool  # routed experts are kept in FP8 (the model's are, whichever a rank loaded)
    device: torch.device
    dtype: torch.dtype
    seed: int

    def stage(
        self,
        wanted: dict[str, list[int]],
        held: dict[str, Experts] | None = None,
        piece_bytes: int = PIECE_BYTES,
    ) -> ExpertStaging:
        """Modules (module name -> its logical experts, slot by slot) to fill piece by piece;
        ``held``: the modules a rank serves with now, by name (what they hold is copied)."""
        return ExpertStaging(self, wanted, held or {}, piece_bytes)

    def build(self, module_name: str, expert_ids: list[int]) -> Experts:
        """One module at once (every piece in a row)."""
        staging = self.stage({module_name: expert_ids})
        while staging.fill_next():
            pass
        return staging.modules[module_name]


@dataclass(frozen=True)
class _Piece:
    """One unit of staging: rows [start, stop) of one expert projection (the checkpoint tensor
    ``name``, a block of its rows or all of them), with its FP8 block scales when it has some."""

    module: str
    name: str
    to: checkpoint.Placement  # where the weight goes in the new module
    to_scale: checkpoint.Placement | None  # where its scales go (weights kept in FP8)
    rows: tuple[int, int]
    held: checkpoint.Placement | None = None  # where the rank's current module holds the same tensor
    held_scale: checkpoint.Placement | None = None


class ExpertStaging:
    """New routed-experts modules filled one piece at a time, bit-identical to what
    ``load_model`` loads for the same experts.

    A piece is one expert projection (gate, up or down) or a block of its rows, at most
    ``piece_bytes`` written and whole 128-row blocks (FP8 scales split with them). What the rank
    already holds (``held``) is copied from there; the rest is read from the checkpoint (only the
    piece's rows, memory-mapped, dequantized where the model does) or drawn (dummy weights: one
    piece per projection, the generator draws the whole tensor). Every module is allocated up
    front (on the CPU the pages are touched, so paid for, by the pieces)."""

    def __init__(
        self, source: ExpertSource, wanted: dict[str, list[int]], held: dict[str, Experts], piece_bytes: int
    ) -> None:
        if piece_bytes < 1:
            raise ValueError(f"piece_bytes must be positive, got {piece_bytes}")
        self.source = source
        self.modules: dict[str, Experts] = {}
        self._params: dict[str, dict[str, torch.Tensor]] = {}
        self._held_params: dict[str, dict[str, torch.Tensor]] = {}
        self._reader = checkpoint.CheckpointReader(source.index) if source.index else None
        self._pieces: deque[_Piece] = deque()
        for module_name, expert_ids in wanted.items():
            self._plan(module_name, expert_ids, held.get(module_name), piece_bytes)
        self.total = len(self._pieces)

    @property
    def pieces_left(self) -> int:
        return len(self._pieces)

    def _plan(self, module_name: str, expert_ids: list[int], held: Experts | None, piece_bytes: int) -> None:
        s = self.source
        with torch.device("meta"):
            experts = Experts(s.config, s.ops, expert_ids)
        prefix = checkpoint.checkpoint_prefix(module_name, s.config)
        if s.fp8:
            experts.make_fp8()
        table = _module_table(experts, prefix, s.config, s.fp8)
        params = {
            name.lstrip("."): t for name, t in checkpoint.materialize(experts, s.device, s.dtype).items()
        }
        self.modules[module_name], self._params[module_name] = experts, params
        held_table: dict[str, list[checkpoint.Placement]] = {}
        if held is not None:
            held_table = _module_table(held, prefix, s.config, s.fp8)
            self._held_params[module_name] = dict(held.named_parameters())
        for name, places in table.items():
            if name.endswith(checkpoint.SCALE_SUFFIX):
                continue  # with its weight
            scales = table.get(name + checkpoint.SCALE_SUFFIX, [None] * len(places))
            for to, to_scale in zip(places, scales, strict=True):
                found = held_table.get(name)
                held_at = found[0] if found else None
                held_scale = (
                    held_table[name + checkpoint.SCALE_SUFFIX][0] if found and to_scale is not None else None
                )
                n = to.shape[0]
                if held_at is None and self._reader is None:
                    blocks = [(0, n)]  # a drawn tensor comes whole
                else:
                    row_bytes = to.shape[1] * params[to.param].element_size()
                    step = max(FP8_BLOCK, piece_bytes // row_bytes // FP8_BLOCK * FP8_BLOCK)
                    blocks = [(a, min(a + step, n)) for a in range(0, n, step)]
                for rows in blocks:
                    self._pieces.append(_Piece(module_name, name, to, to_scale, rows, held_at, held_scale))

    def fill_next(self) -> bool:
        """Fill one piece; -> whether pieces are left."""
        p = self._pieces.popleft()
        params = self._params[p.module]
        scale_rows = (p.rows[0] // FP8_BLOCK, math.ceil(p.rows[1] / FP8_BLOCK))
        if p.held is not None:
            held = self._held_params[p.module]
            checkpoint.view(params, p.to, p.rows).copy_(checkpoint.view(held, p.held, p.rows))
            if p.to_scale is not None and p.held_scale is not None:
                checkpoint.view(params, p.to_scale, scale_rows).copy_(
                    checkpoint.view(held, p.held_scale, scale_rows)
                )
        elif self._reader is not None:
            weight, scale = self._read(p, scale_rows)
            target = checkpoint.view(params, p.to, p.rows)
            target.copy_(weight.to(target.dtype))
            if p.to_scale is not None:
                assert scale is not None
                checkpoint.view(params, p.to_scale, scale_rows).copy_(scale)
        else:
            s = self.source
            weight = checkpoint.dummy_tensor(p.name, p.to.shape, s.config, s.seed, s.device)
            if p.to_scale is not None:
                weight, scale = quantize_weight_128x128(weight)
                checkpoint.view(params, p.to_scale, None).copy_(scale)
            target = checkpoint.view(params, p.to, None)
            target.copy_(weight.to(target.dtype))
        return bool(self._pieces)

    def _read(self, p: _Piece, scale_rows: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The piece's rows of a checkpoint tensor (dequantized unless kept FP8) and of its scales."""
        assert self._reader is not None
        weight = self._reader.rows(p.name, p.to.shape, p.rows)
        if weight.dtype != checkpoint.FP8:
            return weight, None
        scale_name = p.name + checkpoint.SCALE_SUFFIX
        if scale_name not in self._reader.index:
            raise checkpoint.CheckpointError(f"FP8 tensor {p.name} has no {scale_name} in the checkpoint")
        scale = self._reader.rows(scale_name, checkpoint.scale_shape(p.to.shape), scale_rows)
        if p.to_scale is not None:  # kept FP8
            return weight, scale
        return dequantize_weight_128x128(weight, scale.float(), torch.float32), None


def _module_table(
    experts: Experts, prefix: str, config: ModelConfig, fp8: bool
) -> dict[str, list[checkpoint.Placement]]:
    """Checkpoint tensor name -> where it goes in one routed-experts module (params named w13, ...)."""
    names = {f"{prefix}.{e}.{p}_proj.weight" for e in experts.expert_ids for p in ("gate", "up", "down")}
    table: dict[str, list[checkpoint.Placement]] = defaultdict(list)
    checkpoint.expert_placements(table, "", prefix, experts, config, names if fp8 else set())
    return {
        n: [checkpoint.Placement(p.param.lstrip("."), p.shape, p.slot, p.rows) for p in ps]
        for n, ps in table.items()
    }
