"""Checkpoint loading: Hugging Face safetensors (sharded, memory-mapped, FP8 block scales) or dummy weights.

The model is built on the meta device; every parameter is then materialized once on the target
device from the checkpoint tensor(s) that a single table (``_placements``) assigns to it. The same
table tells which tensors are missing. FP8 weights stay FP8 where ``ops`` runs FP8 GEMMs and are
dequantized (``q * scale_inv`` per 128x128 block) otherwise.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from dsinfer.base.config import FP8_BLOCK, LOAD_FORMATS, ConfigError, ModelConfig
from dsinfer.base.model_config import read_model_config
from dsinfer.base.presets import resolve_model
from dsinfer.base.v4_config import V4Config
from dsinfer.model.checkpoint import (
    FP8,
    SCALE_SUFFIX,
    CheckpointError,
    CheckpointReader,
    Placement,
    checkpoint_prefix,
    dummy_tensor,
    expert_placements,
    materialize,
    read_index,
    scale_shape,
    view,
)
from dsinfer.model.deepseek_v3 import DeepseekV3ForCausalLM
from dsinfer.model.expert_staging import ExpertSource
from dsinfer.model.layers import Linear
from dsinfer.model.moe import ExpertParallel, Experts
from dsinfer.model.v4_experts import V4ExpertSource
from dsinfer.model.v4_loader import checkpoint_key, load_v4, mtp_layers_in
from dsinfer.model.v4_served import ServedV4
from dsinfer.ops import Ops
from dsinfer.ops.fp8 import quantize_weight_128x128
from dsinfer.parallel.ep import EPGroup
from dsinfer.parallel.placement import ExpertPlacement, moe_layer_ids

log = logging.getLogger("dsinfer.loader")

__all__ = ["LOAD_FORMATS", "CheckpointError", "LoadedModel", "load_model"]


@dataclass
class LoadedModel:
    model: DeepseekV3ForCausalLM | ServedV4
    config: ModelConfig | V4Config
    path: Path
    load_format: str
    experts: ExpertSource | V4ExpertSource | None  # where EPLB reads experts from (None: V4, one rank)


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
    draft_dtype: torch.dtype | None = None,
) -> LoadedModel:
    """Build and load a model. ``num_mtp_layers`` None = every MTP layer the checkpoint carries.
    ``draft_dtype``: the MTP layers' high-precision weights in this dtype (None: ``dtype``).

    With ``ep_group`` the rank hosts, and reads from the checkpoint, only the expert slots the
    placement gives it (``placement``, else the default layout with ``num_redundant_experts``)."""
    if load_format not in LOAD_FORMATS:
        raise CheckpointError(f"load_format {load_format!r} unknown (choose from {', '.join(LOAD_FORMATS)})")
    path, is_preset = resolve_model(source)
    try:
        any_config = read_model_config(path / "config.json")
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    if isinstance(any_config, V4Config):
        refused = [
            (load_format == "dummy", "load_format 'dummy'"),
            (expert_ids is not None, "a subset of experts without an expert-parallel group"),
            (draft_dtype not in (None, dtype), "an MTP layer in a dtype other than the model's"),
        ]
        for bad, what in refused:
            if bad:
                raise CheckpointError(f"{path}: {what} is not served for DeepSeek-V4 yet")
        available = mtp_layers_in(checkpoint_key(n) for n in read_index(path))
        if num_mtp_layers is None:
            num_mtp_layers = available
        elif num_mtp_layers > available:
            raise CheckpointError(
                f"{path}: {num_mtp_layers} MTP layer(s) requested but the checkpoint has {available} "
                "(no mtp.N.* tensors)"
            )
        v4_ep = None
        if ep_group is not None:
            v4_ep = ExpertParallel(
                _placement(any_config, ep_group.size, placement, num_redundant_experts, num_mtp_layers),
                ep_group,
            )
        model = load_v4(path, ops, dtype, v4_ep, num_mtp_layers=num_mtp_layers).to(device).eval()
        log.info(
            "loaded %s (DeepSeek-V4, dtype %s%s) on %s",
            path,
            str(dtype).removeprefix("torch."),
            f", expert slots of rank {ep_group.rank} of {ep_group.size}" if ep_group is not None else "",
            device,
        )
        experts = V4ExpertSource(path, num_mtp_layers) if ep_group is not None else None
        return LoadedModel(ServedV4(model), any_config, path, "safetensors", experts)
    config = any_config
    device = torch.device(device)
    index = read_index(path) if load_format != "dummy" else {}
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
    params = materialize(model, device, dtype)
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
        _fill_dummy(params, placements, config, seed, keep_fp8, device)
    else:
        _fill_from_checkpoint(params, placements, index, keep_fp8)
    model.post_load(dtype, draft_dtype)
    model.eval()
    experts_fp8 = any(".mlp.experts." in n for n in keep_fp8)
    source = ExpertSource(config, ops, index, experts_fp8, device, dtype, seed)
    return LoadedModel(model, config, path, load_format, source)


def _placement(
    config: ModelConfig | V4Config,
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


def _mtp_layers_in(index: dict[str, Path], config: ModelConfig) -> int:
    layers = {int(n.split(".")[2]) for n in index if n.startswith("model.layers.")}
    count = 0
    while count < config.num_nextn_predict_layers and config.num_hidden_layers + count in layers:
        count += 1
    return count


def _placements(model: nn.Module, config: ModelConfig, fp8_names: set[str]) -> dict[str, list[Placement]]:
    """checkpoint tensor name -> where it goes (several places for a replicated expert);
    ``fp8_names``: weights kept FP8 (their scales load too)."""
    table: dict[str, list[Placement]] = defaultdict(list)
    for module_name, module in model.named_modules():
        prefix = checkpoint_prefix(module_name, config)
        if isinstance(module, Experts):
            expert_placements(table, module_name, prefix, module, config, fp8_names)
            continue
        for param_name, param in module.named_parameters(recurse=False):
            name = f"{prefix}.{param_name}"
            if param_name == "weight_scale_inv":
                continue  # listed with its weight below
            table[name].append(Placement(f"{module_name}.{param_name}", tuple(param.shape)))
            if name in fp8_names:
                table[name + SCALE_SUFFIX].append(
                    Placement(f"{module_name}.weight_scale_inv", scale_shape(tuple(param.shape)))
                )
    return dict(table)


def _fp8_by_convention(model: DeepseekV3ForCausalLM) -> set[str]:
    """Weights DeepSeek ships in FP8: attention projections, MLPs, shared and routed experts, and
    V3.2's indexer projections (its head weights stay high precision)."""
    fp8_suffixes = ("_proj.weight", "_proj_with_mqa.weight", "indexer.wq_b.weight", "indexer.wk.weight")
    kept_suffixes = ("eh_proj.weight", "indexer.weights_proj.weight")
    return {
        name
        for name in _placements(model, model.config, set())
        if name.endswith(fp8_suffixes) and not name.endswith(kept_suffixes)
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
        prefix = checkpoint_prefix(module_name, config)
        if (isinstance(module, Linear) and f"{prefix}.weight" in fp8_names) or (
            isinstance(module, Experts) and f"{prefix}.{module.expert_ids[0]}.gate_proj.weight" in fp8_names
        ):
            module.make_fp8()


def _place(params: dict[str, torch.Tensor], places: list[Placement], tensor: torch.Tensor, name: str) -> None:
    for where in places:
        if tuple(tensor.shape) != where.shape:
            raise CheckpointError(
                f"tensor {name}: shape {list(tensor.shape)} does not match {list(where.shape)} expected from config.json"
            )
        target = view(params, where, None)
        target.copy_(tensor.to(target.dtype))


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
    reader = CheckpointReader(index)
    names = sorted(placements, key=lambda n: str(index[n]))  # one shard after another
    for name in tqdm(names, desc="Loading weights", unit="tensor", dynamic_ncols=True, disable=not progress):
        tensor = reader.get(name)
        if tensor.dtype == FP8 and name not in keep_fp8:
            tensor = reader.dequantized(name, tensor)
        _place(params, placements[name], tensor, name)


def _fill_dummy(
    params: dict[str, torch.Tensor],
    placements: dict[str, list[Placement]],
    config: ModelConfig,
    seed: int,
    keep_fp8: set[str],
    device: torch.device,
    progress: bool = True,
) -> None:
    bar = tqdm(
        placements.items(), desc="Dummy weights", unit="tensor", dynamic_ncols=True, disable=not progress
    )
    for name, places in bar:
        if name.endswith(SCALE_SUFFIX):
            continue
        tensor = dummy_tensor(name, places[0].shape, config, seed, device)
        if name in keep_fp8:
            tensor, scale = quantize_weight_128x128(tensor)
            _place(params, placements[name + SCALE_SUFFIX], scale, name + SCALE_SUFFIX)
        _place(params, places, tensor, name)
