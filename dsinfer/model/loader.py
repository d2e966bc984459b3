"""Checkpoint loading: Hugging Face safetensors (sharded, memory-mapped, FP8 block scales) or dummy weights.

The model is built on the meta device; every parameter is then materialized once on the target
device from the checkpoint tensor(s) that a single table (``_placements``) assigns to it. The same
table tells which tensors are missing. FP8 weights stay FP8 where ``ops`` runs FP8 GEMMs and are
dequantized (``q * scale_inv`` per 128x128 block) otherwise.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections import defaultdict, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from tqdm import tqdm

from dsinfer.base.config import FP8_BLOCK, ConfigError, ModelConfig
from dsinfer.base.presets import resolve_model
from dsinfer.model.deepseek_v3 import DeepseekV3ForCausalLM
from dsinfer.model.layers import Linear
from dsinfer.model.moe import ExpertParallel, Experts
from dsinfer.ops import Ops
from dsinfer.ops.fp8 import dequantize_weight_128x128, quantize_weight_128x128
from dsinfer.parallel.ep import EPGroup
from dsinfer.parallel.placement import ExpertPlacement, moe_layer_ids

log = logging.getLogger("dsinfer.loader")

LOAD_FORMATS = ("auto", "safetensors", "dummy")
SCALE_SUFFIX = "_scale_inv"
FP8 = torch.float8_e4m3fn
PIECE_BYTES = 2 << 20  # the most one expert-staging piece writes (whole 128-row blocks, at least one)


class CheckpointError(ValueError):
    """A checkpoint dsinfer cannot load; the message names the file, tensor or field."""


@dataclass(frozen=True)
class Placement:
    """Where one checkpoint tensor goes: ``param[slot][rows]`` (slot/rows None = the whole param)."""

    param: str
    shape: tuple[int, ...]
    slot: int | None = None
    rows: tuple[int, int] | None = None


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
    to: Placement  # where the weight goes in the new module
    to_scale: Placement | None  # where its scales go (weights kept in FP8)
    rows: tuple[int, int]
    held: Placement | None = None  # where the rank's current module holds the same tensor
    held_scale: Placement | None = None


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
        self._reader = _Reader(source.index) if source.index else None
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
        prefix = _checkpoint_prefix(module_name, s.config)
        if s.fp8:
            experts.make_fp8()
        table = _module_table(experts, prefix, s.config, s.fp8)
        params = {name.lstrip("."): t for name, t in _materialize(experts, s.device, s.dtype).items()}
        self.modules[module_name], self._params[module_name] = experts, params
        held_table: dict[str, list[Placement]] = {}
        if held is not None:
            held_table = _module_table(held, prefix, s.config, s.fp8)
            self._held_params[module_name] = dict(held.named_parameters())
        for name, places in table.items():
            if name.endswith(SCALE_SUFFIX):
                continue  # with its weight
            scales = table.get(name + SCALE_SUFFIX, [None] * len(places))
            for to, to_scale in zip(places, scales, strict=True):
                found = held_table.get(name)
                held_at = found[0] if found else None
                held_scale = held_table[name + SCALE_SUFFIX][0] if found and to_scale is not None else None
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
            _view(params, p.to, p.rows).copy_(_view(held, p.held, p.rows))
            if p.to_scale is not None and p.held_scale is not None:
                _view(params, p.to_scale, scale_rows).copy_(_view(held, p.held_scale, scale_rows))
        elif self._reader is not None:
            weight, scale = self._read(p, scale_rows)
            target = _view(params, p.to, p.rows)
            target.copy_(weight.to(target.dtype))
            if p.to_scale is not None:
                assert scale is not None
                _view(params, p.to_scale, scale_rows).copy_(scale)
        else:
            s = self.source
            weight = _dummy_tensor(p.name, p.to.shape, s.config, s.seed)
            if p.to_scale is not None:
                weight, scale = quantize_weight_128x128(weight)
                _view(params, p.to_scale, None).copy_(scale)
            target = _view(params, p.to, None)
            target.copy_(weight.to(target.dtype))
        return bool(self._pieces)

    def _read(self, p: _Piece, scale_rows: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The piece's rows of a checkpoint tensor (dequantized unless kept FP8) and of its scales."""
        assert self._reader is not None
        weight = self._reader.rows(p.name, p.to.shape, p.rows)
        if weight.dtype != FP8:
            return weight, None
        scale_name = p.name + SCALE_SUFFIX
        if scale_name not in self._reader.index:
            raise CheckpointError(f"FP8 tensor {p.name} has no {scale_name} in the checkpoint")
        scale = self._reader.rows(scale_name, _scale_shape(p.to.shape), scale_rows)
        if p.to_scale is not None:  # kept FP8
            return weight, scale
        return dequantize_weight_128x128(weight, scale.float(), torch.float32), None


def _module_table(
    experts: Experts, prefix: str, config: ModelConfig, fp8: bool
) -> dict[str, list[Placement]]:
    """Checkpoint tensor name -> where it goes in one routed-experts module (params named w13, ...)."""
    names = {f"{prefix}.{e}.{p}_proj.weight" for e in experts.expert_ids for p in ("gate", "up", "down")}
    table: dict[str, list[Placement]] = defaultdict(list)
    _expert_placements(table, "", prefix, experts, config, names if fp8 else set())
    return {
        n: [Placement(p.param.lstrip("."), p.shape, p.slot, p.rows) for p in ps] for n, ps in table.items()
    }


@dataclass
class LoadedModel:
    model: DeepseekV3ForCausalLM
    config: ModelConfig
    path: Path
    load_format: str
    experts: ExpertSource


def load_model(
    source: str | Path | None,
    ops: Ops,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    load_format: str = "auto",
    num_mtp_layers: int | None = None,
    expert_ids: list[int] | None = None,
    seed: int = 0,
    ep_group: EPGroup | None = None,
    placement: ExpertPlacement | None = None,
    num_redundant_experts: int = 0,
) -> LoadedModel:
    """Build and load a model. ``num_mtp_layers`` None = every MTP layer the checkpoint carries.

    With ``ep_group`` the rank hosts, and reads from the checkpoint, only the expert slots the
    placement gives it (``placement``, else the default layout with ``num_redundant_experts``)."""
    if load_format not in LOAD_FORMATS:
        raise CheckpointError(f"load_format {load_format!r} unknown (choose from {', '.join(LOAD_FORMATS)})")
    path, is_preset = resolve_model(source)
    try:
        config = ModelConfig.from_file(path / "config.json")
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    device = torch.device(device)
    index = _read_index(path) if load_format != "dummy" else {}
    if load_format == "auto":
        if not index and not is_preset:
            raise CheckpointError(
                f"{path}: no *.safetensors files (use load_format 'dummy' for random weights)"
            )
        load_format = "safetensors" if index else "dummy"
    if load_format == "safetensors" and not index:
        raise CheckpointError(f"{path}: no *.safetensors files")

    available_mtp = (
        _mtp_layers_in(index, config) if load_format == "safetensors" else config.num_nextn_predict_layers
    )
    if num_mtp_layers is None:
        num_mtp_layers = available_mtp
    elif num_mtp_layers > available_mtp:
        raise CheckpointError(
            f"{path}: {num_mtp_layers} MTP layer(s) requested but the checkpoint has {available_mtp} "
            f"(no model.layers.{config.num_hidden_layers}.* tensors)"
        )
    ep = None
    if ep_group is not None:
        ep = ExpertParallel(
            _placement(config, ep_group.size, placement, num_redundant_experts, num_mtp_layers), ep_group
        )
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(
            config, ops, num_mtp_layers=num_mtp_layers, expert_ids=expert_ids, ep=ep
        )
    fp8_names = {n.removesuffix(SCALE_SUFFIX) for n in index if n.endswith(".weight" + SCALE_SUFFIX)}
    if load_format == "dummy" and config.is_fp8:
        fp8_names = _fp8_by_convention(model)
    keep_fp8 = _fp8_kept(fp8_names, config) if ops.supports_fp8_gemm else set()
    placements = _placements(model, config, keep_fp8)
    _make_fp8(model, keep_fp8)
    params = _materialize(model, device, dtype)
    log.info(
        "loading %s (%s, %d tensors, dtype %s, fp8: %d weights kept, %d dequantized) on %s",
        path,
        load_format,
        len(placements),
        str(dtype).removeprefix("torch."),
        len(keep_fp8),
        len(fp8_names - keep_fp8) if load_format != "dummy" else 0,
        device,
    )
    if load_format == "dummy":
        _fill_dummy(params, placements, config, seed, keep_fp8)
    else:
        _fill_from_checkpoint(params, placements, index, keep_fp8)
    model.post_load(dtype)
    model.eval()
    experts_fp8 = any(".mlp.experts." in n for n in keep_fp8)
    source = ExpertSource(config, ops, index, experts_fp8, device, dtype, seed)
    return LoadedModel(model, config, path, load_format, source)


def _placement(
    config: ModelConfig,
    num_ranks: int,
    placement: ExpertPlacement | None,
    num_redundant: int,
    num_mtp_layers: int,
) -> ExpertPlacement:
    if placement is None:
        return ExpertPlacement.for_model(config, num_ranks, num_redundant, num_mtp_layers)
    try:
        placement.check_matches(moe_layer_ids(config, num_mtp_layers), config.n_routed_experts, num_ranks)
    except ValueError as e:
        raise CheckpointError(f"expert placement does not fit this model and pool: {e}") from None
    return placement


# Checkpoint files ----------------------------------------------------------------------------
def _read_index(path: Path) -> dict[str, Path]:
    """tensor name -> safetensors file, from model.safetensors.index.json or the files' headers."""
    index_file = path / "model.safetensors.index.json"
    if index_file.is_file():
        try:
            weight_map = json.loads(index_file.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index_file}: not a safetensors index ({e})") from None
        index = {name: path / file for name, file in weight_map.items()}
        for file in sorted(set(index.values())):
            if not file.is_file():
                raise CheckpointError(f"{index_file}: lists {file.name}, which does not exist")
        return index
    index = {}
    for file in sorted(path.glob("*.safetensors")):
        with _open(file) as f:
            index.update(dict.fromkeys(f.keys(), file))
    return index


def _open(file: Path):
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{file}: truncated or corrupt safetensors file ({e})") from None


def _mtp_layers_in(index: dict[str, Path], config: ModelConfig) -> int:
    layers = {int(n.split(".")[2]) for n in index if n.startswith("model.layers.")}
    count = 0
    while count < config.num_nextn_predict_layers and config.num_hidden_layers + count in layers:
        count += 1
    return count


# The placement table -------------------------------------------------------------------------
def _checkpoint_prefix(module_name: str, config: ModelConfig) -> str:
    if module_name.startswith("mtp_layers."):
        parts = module_name.split(".", 2)
        layer = f"model.layers.{config.num_hidden_layers + int(parts[1])}"
        return layer if len(parts) == 2 else f"{layer}.{parts[2]}"
    return module_name


def _placements(model: nn.Module, config: ModelConfig, fp8_names: set[str]) -> dict[str, list[Placement]]:
    """checkpoint tensor name -> where it goes (several places for a replicated expert);
    ``fp8_names``: weights kept FP8 (their scales load too)."""
    table: dict[str, list[Placement]] = defaultdict(list)
    for module_name, module in model.named_modules():
        prefix = _checkpoint_prefix(module_name, config)
        if isinstance(module, Experts):
            _expert_placements(table, module_name, prefix, module, config, fp8_names)
            continue
        for param_name, param in module.named_parameters(recurse=False):
            name = f"{prefix}.{param_name}"
            if param_name == "weight_scale_inv":
                continue  # listed with its weight below
            table[name].append(Placement(f"{module_name}.{param_name}", tuple(param.shape)))
            if name in fp8_names:
                table[name + SCALE_SUFFIX].append(
                    Placement(f"{module_name}.weight_scale_inv", _scale_shape(tuple(param.shape)))
                )
    return dict(table)


def _expert_placements(
    table: dict[str, list[Placement]],
    module_name: str,
    prefix: str,
    module: Experts,
    config: ModelConfig,
    fp8_names: set[str],
) -> None:
    inter, hidden = config.moe_intermediate_size, config.hidden_size
    for slot, expert in enumerate(module.expert_ids):
        base = f"{prefix}.{expert}"
        parts = (
            ("gate", "w13", (0, inter), (inter, hidden)),
            ("up", "w13", (inter, 2 * inter), (inter, hidden)),
            ("down", "w2", None, (hidden, inter)),
        )
        for proj, param, rows, shape in parts:
            name = f"{base}.{proj}_proj.weight"
            table[name].append(Placement(f"{module_name}.{param}", shape, slot, rows))
            if name in fp8_names:
                scale_rows = None if rows is None else (rows[0] // FP8_BLOCK, rows[1] // FP8_BLOCK)
                table[name + SCALE_SUFFIX].append(
                    Placement(f"{module_name}.{param}_scale_inv", _scale_shape(shape), slot, scale_rows)
                )


def _scale_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    return math.ceil(shape[0] / FP8_BLOCK), math.ceil(shape[1] / FP8_BLOCK)


def _fp8_by_convention(model: DeepseekV3ForCausalLM) -> set[str]:
    """Weights DeepSeek ships in FP8: attention projections, MLPs, shared and routed experts."""
    return {
        name
        for name in _placements(model, model.config, set())
        if name.endswith(("_proj.weight", "_proj_with_mqa.weight")) and not name.endswith("eh_proj.weight")
    }


def _fp8_kept(fp8_names: set[str], config: ModelConfig) -> set[str]:
    """FP8 weights the model keeps in FP8. Stacked expert gate/up rows share 128-row scale blocks,
    so experts stay FP8 only when moe_intermediate_size is a multiple of 128 (true of every
    released checkpoint); otherwise they are dequantized."""
    if config.moe_intermediate_size % FP8_BLOCK == 0:
        return set(fp8_names)
    return {n for n in fp8_names if ".mlp.experts." not in n}


def _make_fp8(model: nn.Module, fp8_names: set[str]) -> None:
    config = model.config
    for module_name, module in model.named_modules():
        prefix = _checkpoint_prefix(module_name, config)
        if (isinstance(module, Linear) and f"{prefix}.weight" in fp8_names) or (
            isinstance(module, Experts) and f"{prefix}.{module.expert_ids[0]}.gate_proj.weight" in fp8_names
        ):
            module.make_fp8()


def _materialize(model: nn.Module, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Replace meta parameters with real (uninitialized) ones; move computed buffers to ``device``.
    FP8 weights stay FP8; block scales and the router's score-correction bias stay fp32."""
    params = {}
    for module_name, module in model.named_modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            fp32 = name.endswith(SCALE_SUFFIX) or name == "e_score_correction_bias"
            target = FP8 if param.dtype == FP8 else torch.float32 if fp32 else dtype
            tensor = torch.empty(param.shape, dtype=target, device=device)
            module._parameters[name] = nn.Parameter(tensor, requires_grad=False)
            params[f"{module_name}.{name}" if module_name else name] = tensor
        for name, buffer in list(module._buffers.items()):
            if buffer is not None:
                module._buffers[name] = buffer.to(device)
    return params


# Filling -------------------------------------------------------------------------------------
def _place(params: dict[str, torch.Tensor], places: list[Placement], tensor: torch.Tensor, name: str) -> None:
    for where in places:
        if tuple(tensor.shape) != where.shape:
            raise CheckpointError(
                f"tensor {name}: shape {list(tensor.shape)} does not match {list(where.shape)} expected from config.json"
            )
        target = _view(params, where, None)
        target.copy_(tensor.to(target.dtype))


def _view(params: dict[str, torch.Tensor], where: Placement, rows: tuple[int, int] | None) -> torch.Tensor:
    """The part of a parameter ``where`` names; ``rows``: only these rows of it."""
    target = params[where.param]
    if where.slot is not None:
        target = target[where.slot]
    if where.rows is not None:
        target = target[where.rows[0] : where.rows[1]]
    return target if rows is None else target[rows[0] : rows[1]]


def _fill_from_checkpoint(
    params: dict[str, torch.Tensor],
    placements: dict[str, list[Placement]],
    index: dict[str, Path],
    keep_fp8: set[str],
    progress: bool = True,
) -> None:
    missing = [n for n in placements if n not in index]
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise CheckpointError(f"checkpoint is missing tensor {shown}")
    unused = [n for n in index if n not in placements and not n.endswith(SCALE_SUFFIX)]
    if unused and progress:
        log.info("ignoring %d checkpoint tensors this model does not use (e.g. %s)", len(unused), unused[0])
    reader = _Reader(index)
    names = sorted(placements, key=lambda n: str(index[n]))  # one shard after another
    for name in tqdm(names, desc="Loading weights", unit="tensor", dynamic_ncols=True, disable=not progress):
        tensor = reader.get(name)
        if tensor.dtype == FP8 and name not in keep_fp8:
            tensor = reader.dequantized(name, tensor)
        _place(params, placements[name], tensor, name)


class _Reader:
    """Memory-mapped tensors by name, each shard opened once."""

    def __init__(self, index: dict[str, Path]) -> None:
        self.index, self.handles = index, {}

    def _handle(self, name: str) -> tuple[Path, Any]:
        file = self.index.get(name)
        if file is None:
            raise CheckpointError(f"checkpoint is missing tensor {name}")
        if file not in self.handles:
            self.handles[file] = _open(file)
        return file, self.handles[file]

    def get(self, name: str) -> torch.Tensor:
        file, handle = self._handle(name)
        try:
            return handle.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{file}: cannot read tensor {name} ({e})") from None

    def rows(self, name: str, shape: tuple[int, ...], rows: tuple[int, int]) -> torch.Tensor:
        """Rows [start, stop) of a tensor that must have ``shape`` (only those rows are read)."""
        file, handle = self._handle(name)
        try:
            part = handle.get_slice(name)
            if tuple(part.get_shape()) != shape:
                raise CheckpointError(
                    f"tensor {name}: shape {list(part.get_shape())} does not match {list(shape)} expected from config.json"
                )
            return part[rows[0] : rows[1]]
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{file}: cannot read tensor {name} ({e})") from None

    def dequantized(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        scale_name = name + SCALE_SUFFIX
        if scale_name not in self.index:
            raise CheckpointError(f"FP8 tensor {name} has no {scale_name} in the checkpoint")
        scale = self.get(scale_name)
        if tuple(scale.shape) != _scale_shape(tuple(weight.shape)):
            raise CheckpointError(
                f"tensor {scale_name}: shape {list(scale.shape)} does not fit weight {name} {list(weight.shape)}"
            )
        return dequantize_weight_128x128(weight, scale.float(), torch.float32)


def _dummy_tensor(name: str, shape: tuple[int, ...], config: ModelConfig, seed: int) -> torch.Tensor:
    """Random weights from a generator seeded by the tensor's checkpoint name (which holds the
    layer and logical expert id), so every rank and replica builds the same model."""
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith("e_score_correction_bias"):
        return torch.zeros(shape)
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    generator = torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    return torch.randn(shape, generator=generator) * config.initializer_range


def _fill_dummy(
    params: dict[str, torch.Tensor],
    placements: dict[str, list[Placement]],
    config: ModelConfig,
    seed: int,
    keep_fp8: set[str],
    progress: bool = True,
) -> None:
    bar = tqdm(
        placements.items(), desc="Dummy weights", unit="tensor", dynamic_ncols=True, disable=not progress
    )
    for name, places in bar:
        if name.endswith(SCALE_SUFFIX):
            continue
        tensor = _dummy_tensor(name, places[0].shape, config, seed)
        if name in keep_fp8:
            tensor, scale = quantize_weight_128x128(tensor)
            _place(params, placements[name + SCALE_SUFFIX], scale, name + SCALE_SUFFIX)
        _place(params, places, tensor, name)
