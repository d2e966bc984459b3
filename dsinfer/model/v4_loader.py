"""Reading a DeepSeek-V4 checkpoint onto ``DeepseekV4ForCausalLM``.

Tensor names: the release's (``layers.N.attn.wq_a.weight``, ``embed.weight``, ``hc_head_fn``) or
transformers' (``model.`` prefix, ``embed_tokens``, ``hc_head.hc_fn``...); ``checkpoint_key`` maps
both onto the model's. Weights: high precision; or FP8 e4m3 with one scale per 128x128 block,
``<module>.scale`` in the release (e8m0: powers of two) or ``<module>.weight_scale_inv`` (fp32),
kept FP8 in the linear layers where the ops run FP8 GEMMs (``ops.supports_fp8_gemm``) and
dequantized at load otherwise (the CPU, as for V3); routed experts FP8 as well or MXFP4 (packed
bytes, e8m0 per 32 values: dsinfer/ops/mxfp4.py). MXFP4 experts stay packed where the ops run the
MXFP4 grouped GEMM on a kernel (``keep_mxfp4``; a quarter of bf16's bytes), and are dequantized at
load into the model's dtype otherwise, as the reference MoE computes in it. The release's MTP
layers (``mtp.N.*``; transformers keeps none) are read when asked for (``num_mtp_layers``) and
passed over otherwise, as transformers passes them over.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from dsinfer.base.v4_config import V4Config
from dsinfer.model.deepseek_v4 import DeepseekV4ForCausalLM
from dsinfer.model.layers import Linear
from dsinfer.model.moe import ExpertParallel
from dsinfer.ops import Ops
from dsinfer.ops.fp8 import FP8_DTYPE, dequantize_weight_128x128
from dsinfer.ops.mxfp4 import dequantize_mxfp4, scale_to_float

_RENAMES = (
    (r"^model\.", ""),
    (r"^embed_tokens\.", "embed."),
    (r"(^|\.)hc_head[._](hc_)?(fn|base|scale)$", r"\1hc_head.\3"),
    (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2"),
    (r"\.ffn\.gate\.e_score_correction_bias$", ".ffn.gate.bias"),
    (r"\.weight_scale_inv$", ".scale"),
)
_EXPERT = re.compile(r"^((?:layers|mtp)\.\d+\.ffn)\.experts\.(\d+)\.(w[123])\.weight$")
_MTP = re.compile(r"^mtp\.(\d+)\.")


def checkpoint_key(name: str) -> str:
    """A tensor's name in the release layout (transformers saves some names its own way; a
    weight's block scale is ``<module>.scale``)."""
    for pattern, replacement in _RENAMES:
        name = re.sub(pattern, replacement, name)
    return name


def mtp_layers_in(names: Iterable[str]) -> int:
    """How many MTP layers (``mtp.0``, ``mtp.1``, ...) the tensor names hold."""
    found = {int(m.group(1)) for name in names if (m := _MTP.match(name)) is not None}
    count = 0
    while count in found:
        count += 1
    return count


class V4Checkpoint:
    """The checkpoint's tensors by release name, read on demand from their files; MTP layers from
    ``num_mtp_layers`` on are passed over."""

    def __init__(self, path: Path, stack: ExitStack, num_mtp_layers: int = 0) -> None:
        self.where: dict[str, tuple[Any, str]] = {}
        for file in sorted(path.glob("*.safetensors")):
            handle = stack.enter_context(safe_open(file, "pt"))
            for raw in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                name = checkpoint_key(raw)
                mtp = _MTP.match(name)
                if mtp is None or int(mtp.group(1)) < num_mtp_layers:
                    self.where[name] = (handle, raw)
        if not self.where:
            raise ValueError(f"{path}: no *.safetensors file")

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str) -> torch.Tensor:
        handle, raw = self.where[name]
        return handle.get_tensor(raw)

    def names(self) -> Iterator[str]:
        return iter(self.where)


def load_v4(
    path: str | Path,
    ops: Ops,
    dtype: torch.dtype = torch.float32,
    ep: ExpertParallel | None = None,
    keep_mxfp4: bool | None = None,
    num_mtp_layers: int = 0,
) -> DeepseekV4ForCausalLM:
    """A V4 checkpoint directory (config.json and safetensors) -> the model in ``dtype`` (its
    FP8 linear layers kept FP8 where ``ops`` runs FP8 GEMMs); with ``ep`` only this rank's expert
    slots are read. ``keep_mxfp4``: MXFP4 experts stay packed (None: where ``ops`` runs the MXFP4
    GEMM on a kernel). ``num_mtp_layers``: the MTP layers to build and read."""
    path = Path(path)
    config = V4Config.model_validate(json.loads((path / "config.json").read_text()))
    with ExitStack() as stack:
        checkpoint = V4Checkpoint(path, stack, num_mtp_layers)
        packed = _experts_packed(checkpoint)
        if keep_mxfp4 is None:
            keep_mxfp4 = packed and ops.backends.get("mxfp4", "torch") != "torch"
        if keep_mxfp4 and not packed:
            raise ValueError(f"{path}: keep_mxfp4 asks for packed experts, the checkpoint's are not MXFP4")
        model = DeepseekV4ForCausalLM(config, ops, ep, keep_mxfp4, num_mtp_layers).to(dtype)
        for name, module in model.named_modules():
            weight = f"{name}.weight"
            fp8 = weight in checkpoint and checkpoint.get(weight).dtype == FP8_DTYPE
            if isinstance(module, Linear) and fp8 and ops.supports_fp8_gemm:
                module.make_fp8()
        params = dict(model.named_parameters()) | dict(model.named_buffers())
        slots = {f"layers.{i}.ffn": layer.ffn.local_experts for i, layer in enumerate(model.layers)}
        slots |= {f"mtp.{j}.ffn": layer.ffn.local_experts for j, layer in enumerate(model.mtp)}
        loaded = _load_tensors(checkpoint, params) | _load_experts(
            checkpoint, params, slots, config, None if keep_mxfp4 else dtype
        )
    runtime = ("expert_load", "replica_slots", "num_replicas")  # counters and the EP routing table
    counters = {n for n, _ in model.named_buffers() if n.endswith(runtime)}
    missing = sorted(n for n in params if n not in loaded and "inv_freq" not in n and n not in counters)
    if missing:
        raise ValueError(
            f"{path}: no tensor for {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}"
        )
    return model


def _load_tensors(checkpoint: V4Checkpoint, params: dict[str, torch.Tensor]) -> set[str]:
    loaded = set()
    for name in checkpoint.names():
        if _EXPERT.match(name) or (
            name.endswith(".scale") and name.removesuffix(".scale") + ".weight" in checkpoint
        ):
            continue
        if name not in params:
            raise ValueError(f"unexpected tensor {name}")
        tensor = checkpoint.get(name)
        if tensor.dtype == FP8_DTYPE:
            scale_name = name.removesuffix(".weight") + ".scale"
            if scale_name not in checkpoint:
                raise ValueError(f"{name} is FP8 without its block scale ({scale_name})")
            scale = scale_to_float(checkpoint.get(scale_name))
            target = name.removesuffix(".weight") + ".weight_scale_inv"
            if params[name].dtype == FP8_DTYPE:
                _copy(params[target], scale, scale_name)
                loaded.add(target)
            else:
                tensor = dequantize_weight_128x128(tensor, scale, params[name].dtype)
        _copy(params[name], tensor, name)
        loaded.add(name)
    return loaded


def _experts_packed(checkpoint: V4Checkpoint) -> bool:
    """Whether the routed experts are MXFP4 (packed bytes)."""
    name = next((n for n in checkpoint.names() if _EXPERT.match(n)), None)
    return name is not None and checkpoint.get(name).dtype in (torch.uint8, torch.int8)


def _load_experts(
    checkpoint: V4Checkpoint,
    params: dict[str, torch.Tensor],
    slots: dict[str, list[int]],
    config: V4Config,
    dtype: torch.dtype | None,
) -> set[str]:
    """Each layer's routed experts stacked into ``ffn.w13`` (w1 then w3) and ``ffn.w2``, at the
    slots that hold them (``slots``: per layer's ``ffn``, the expert of each slot; an expert
    another rank holds is not read); in ``dtype``, or packed with their scales (None)."""
    loaded = set()
    inner = config.moe_intermediate_size
    for name in checkpoint.names():
        match = _EXPERT.match(name)
        if match is None:
            continue
        prefix, index, which = match.groups()
        targets = [slot for slot, expert in enumerate(slots[prefix]) if expert == int(index)]
        if not targets:
            continue
        if dtype is None:  # packed: the bytes and their e8m0 scales as they are
            scale = checkpoint.get(name.removesuffix(".weight") + ".scale")
            parts = [("", checkpoint.get(name).view(torch.uint8)), ("_scale", scale.view(torch.uint8))]
        else:
            parts = [("", _expert_weight(checkpoint, name, dtype))]
        if which == "w2":
            target, rows = f"{prefix}.w2", slice(None)
        else:
            target, rows = f"{prefix}.w13", slice(0, inner) if which == "w1" else slice(inner, 2 * inner)
        for suffix, tensor in parts:
            for slot in targets:
                _copy(params[target + suffix][slot, rows], tensor, name)
            loaded.add(target + suffix)
    return loaded


def _expert_weight(checkpoint: V4Checkpoint, name: str, dtype: torch.dtype) -> torch.Tensor:
    weight = checkpoint.get(name)
    if weight.is_floating_point() and weight.dtype != FP8_DTYPE:
        return weight
    scale = checkpoint.get(name.removesuffix(".weight") + ".scale")
    if weight.dtype == FP8_DTYPE:
        return dequantize_weight_128x128(weight, scale_to_float(scale), dtype)
    return dequantize_mxfp4(weight, scale, dtype)  # packed e2m1 bytes


def _copy(target: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if tuple(target.shape) != tuple(tensor.shape):
        raise ValueError(f"{name}: shape {tuple(tensor.shape)}, the model expects {tuple(target.shape)}")
    target.data.copy_(tensor)


def read_expert(
    checkpoint: V4Checkpoint, prefix: str, expert: int, dtype: torch.dtype | None
) -> dict[str, torch.Tensor]:
    """Routed expert ``expert`` of the MoE ``prefix`` (``layers.N.ffn``, ``mtp.N.ffn``) as a slot of
    it holds it: ``w13`` (gate then up rows) and ``w2`` in ``dtype``, or with ``dtype`` None the
    packed bytes and their ``w13_scale``/``w2_scale``: what ``load_v4`` puts in a slot."""
    parts = {}
    for which in ("w1", "w3", "w2"):
        name = f"{prefix}.experts.{expert}.{which}.weight"
        if dtype is None:
            scale = checkpoint.get(name.removesuffix(".weight") + ".scale").view(torch.uint8)
            parts[which] = (checkpoint.get(name).view(torch.uint8), scale)
        else:
            parts[which] = (_expert_weight(checkpoint, name, dtype), None)
    out = {"w13": torch.cat([parts["w1"][0], parts["w3"][0]]), "w2": parts["w2"][0]}
    if dtype is None:
        out["w13_scale"] = torch.cat([parts["w1"][1], parts["w3"][1]])
        out["w2_scale"] = parts["w2"][1]
    return out
