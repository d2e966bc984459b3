"""Where an engine runs and what identifies its model: device and dtype names, free memory, and
the model identity that roots the page-hash chains."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from dsinfer.base.hashing import model_root

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def bind_device(device: torch.device) -> None:
    """Make an explicit ``cuda:N`` this process's current CUDA device: CUDA graphs, Triton
    launches and libraries that use the current device (DeepGEMM's stream) then run on it."""
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def free_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read free memory (no /proc/meminfo); pass kv_cache_memory")


def model_identity(
    path: Path,
    load_format: str,
    seed: int,
    dtype: torch.dtype,
    device: torch.device,
    draft_dtype: torch.dtype | None = None,
) -> bytes:
    """Root of the page-hash chains: KV computed by another model (or dtype, or MTP layer's dtype)
    never matches; dummy weights differ per kind of device they were drawn on."""
    digest = hashlib.sha256((path / "config.json").read_bytes())
    index = path / "model.safetensors.index.json"
    if index.is_file():
        digest.update(index.read_bytes())
    for shard in sorted(path.glob("*.safetensors")):
        stat = shard.stat()
        digest.update(f"{shard.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return model_root(
        digest.hexdigest(),
        load_format,
        f"{seed}:{device.type}" if load_format == "dummy" else "",
        str(dtype) if draft_dtype in (None, dtype) else f"{dtype} draft {draft_dtype}",
    )
