"""Checkpoint tensors and where they go, shared by loading (``loader``) and online expert staging
(``expert_staging``): the safetensors index and reader, the placement of a checkpoint tensor in a
parameter, and the seeded dummy weights both draw."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from dsinfer.base.config import FP8_BLOCK, ModelConfig
from dsinfer.model.moe import Experts
from dsinfer.ops.fp8 import dequantize_weight_128x128

SCALE_SUFFIX = "_scale_inv"
FP8 = torch.float8_e4m3fn


class CheckpointError(ValueError):
    """A checkpoint dsinfer cannot load; the message names the file, tensor or field."""


@dataclass(frozen=True)
class Placement:
    """Where one checkpoint tensor goes: ``param[slot][rows]`` (slot/rows None = the whole param)."""

    param: str
    shape: tuple[int, ...]
    slot: int | None = None
    rows: tuple[int, int] | None = None


def read_index(path: Path) -> dict[str, Path]:
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
        with open_shard(file) as f:
            index.update(dict.fromkeys(f.keys(), file))
    return index


def open_shard(file: Path):
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{file}: truncated or corrupt safetensors file ({e})") from None


class CheckpointReader:
    """Memory-mapped tensors by name, each shard opened once."""

    def __init__(self, index: dict[str, Path]) -> None:
        self.index, self.handles = index, {}

    def _handle(self, name: str) -> tuple[Path, Any]:
        file = self.index.get(name)
        if file is None:
            raise CheckpointError(f"checkpoint is missing tensor {name}")
        if file not in self.handles:
            self.handles[file] = open_shard(file)
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
        if tuple(scale.shape) != scale_shape(tuple(weight.shape)):
            raise CheckpointError(
                f"tensor {scale_name}: shape {list(scale.shape)} does not fit weight {name} {list(weight.shape)}"
            )
        return dequantize_weight_128x128(weight, scale.float(), torch.float32)


def checkpoint_prefix(module_name: str, config: ModelConfig) -> str:
    if module_name.startswith("mtp_layers."):
        parts = module_name.split(".", 2)
        layer = f"model.layers.{config.num_hidden_layers + int(parts[1])}"
        return layer if len(parts) == 2 else f"{layer}.{parts[2]}"
    return module_name


def expert_placements(
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
                    Placement(f"{module_name}.{param}_scale_inv", scale_shape(shape), slot, scale_rows)
                )


def scale_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    return math.ceil(shape[0] / FP8_BLOCK), math.ceil(shape[1] / FP8_BLOCK)


def materialize(model: nn.Module, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
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


def view(params: dict[str, torch.Tensor], where: Placement, rows: tuple[int, int] | None) -> torch.Tensor:
    """The part of a parameter ``where`` names; ``rows``: only these rows of it."""
    target = params[where.param]
    if where.slot is not None:
        target = target[where.slot]
    if where.rows is not None:
        target = target[where.rows[0] : where.rows[1]]
    return target if rows is None else target[rows[0] : rows[1]]


def dummy_tensor(
    name: str,
    shape: tuple[int, ...],
    config: ModelConfig,
    seed: int,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Random weights from a generator seeded by the tensor's checkpoint name (which holds the
    layer and logical expert id), so every rank and replica builds the same model. Drawn on
    ``device`` (a full-size model's weights take seconds on a GPU, minutes on a CPU): a CUDA draw
    differs from the CPU draw of the same name, so processes agree per kind of device."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, device=device)
    if name.endswith(("e_score_correction_bias", "norm.bias")):
        return torch.zeros(shape, device=device)
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    generator = torch.Generator(device=device).manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    return torch.randn(shape, generator=generator, device=device) * config.initializer_range
