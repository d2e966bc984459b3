"""Start-up choice of the expert-parallel communication backend of a pool.

``make_ep_group`` returns :class:`~dsinfer.parallel.ep.TorchEPGroup` (all-to-all over the process
group: gloo on CPU, NCCL on GPU) unless DeepEP is importable, exports the Buffer API, the group is
NCCL on CUDA and the model's shape is given; then :class:`~dsinfer.parallel.deepep.DeepEPGroup`
(UNVERIFIED: DeepEP cannot be installed on any machine here), normal mode for prefill pools or
low-latency mode for decode pools. The choice is logged in one line.

Every rank of a pool must make the same choice, so it depends only on what all ranks share
(configuration, the group's backend, the installed software), never on a rank's data. A DeepEP
buffer that fails to build raises instead of falling back: a fallback on some ranks only would
pair mismatched collectives.
"""

from __future__ import annotations

import importlib
import logging
from types import ModuleType

import torch
import torch.distributed as dist

from dsinfer.base.config import EP_BACKENDS
from dsinfer.parallel.deepep import LOW_LATENCY_HIDDEN, DeepEPGroup, missing_buffer_api
from dsinfer.parallel.ep import EPGroup, TorchEPGroup

logger = logging.getLogger("dsinfer.parallel")

__all__ = ["EP_BACKENDS", "deepep_unavailable", "make_ep_group"]


def _import_deep_ep() -> ModuleType | str:
    try:
        return importlib.import_module("deep_ep")
    except Exception as exc:  # a broken CUDA extension raises more than ImportError
        return f"import deep_ep failed: {type(exc).__name__}"


def _config_unsupported(module: ModuleType, world: int, low_latency: bool) -> str | None:
    """Normal mode has tuned configs for some group sizes only (``get_*_config`` asserts otherwise)."""
    if low_latency:
        return None
    try:
        module.Buffer.get_dispatch_config(world)
        module.Buffer.get_combine_config(world)
    except Exception as exc:
        return f"no normal-mode config for {world} ranks ({type(exc).__name__})"
    return None


def deepep_unavailable(
    backend: str,
    cuda: bool,
    world: int,
    *,
    low_latency: bool,
    hidden: int | None,
    num_local_experts: int | None,
) -> str | None:
    """Why DeepEP cannot serve this group, judged before importing it, or None when it may.

    ``backend``: the process group's backend name; ``cuda``: whether a CUDA device is present.
    """
    if backend != "nccl":
        return f"needs an NCCL group, not {backend}"
    if not cuda:
        return "needs CUDA"
    if world < 2:
        return "needs 2 or more ranks"
    if world > 8 and world % 8:
        return f"group size {world} is neither below 8 nor a multiple of 8"
    if hidden is None or num_local_experts is None:
        return "needs hidden and num_local_experts"
    if low_latency and hidden not in LOW_LATENCY_HIDDEN:
        return f"low-latency kernels do not take hidden {hidden}"
    return None


def make_ep_group(
    group: dist.ProcessGroup | None = None,
    *,
    prefer: str = "auto",
    low_latency: bool = False,
    hidden: int | None = None,
    num_local_experts: int | None = None,
    top_k: int = 8,
    max_tokens_per_rank: int = 128,
    use_fp8: bool = True,
) -> EPGroup:
    """The EP group for ``group`` (the default group when None); logs the choice in one line.

    ``prefer``: "auto" = DeepEP when usable, else torch; "deepep" = the same, but the log says why
    DeepEP was not taken; "torch" = torch all-to-all always. ``low_latency``: DeepEP's decode mode
    (``max_tokens_per_rank`` tokens per step at most, ``top_k`` routed experts per token, FP8
    dispatch with ``use_fp8``). ``hidden`` and ``num_local_experts`` (expert slots per rank) size
    DeepEP's buffers; without them DeepEP is not used.
    """
    if prefer not in EP_BACKENDS:
        raise ValueError(f"unknown EP backend {prefer!r}; choose from {list(EP_BACKENDS)}")
    torch_group = TorchEPGroup(group)
    backend = str(dist.get_backend(group))
    why: str | None = "torch preferred"
    if prefer != "torch":
        why = deepep_unavailable(
            backend,
            torch.cuda.is_available(),
            torch_group.size,
            low_latency=low_latency,
            hidden=hidden,
            num_local_experts=num_local_experts,
        )
    module: ModuleType | str | None = None
    if why is None:
        module = _import_deep_ep()
        if isinstance(module, str):
            why = module
        else:
            why = missing_buffer_api(module) or _config_unsupported(module, torch_group.size, low_latency)
    if why is not None or not isinstance(module, ModuleType):
        line = f"ep backend: torch all-to-all ({backend}, {torch_group.size} ranks)"
        if prefer == "deepep" or (backend == "nccl" and prefer == "auto"):
            line += f"; no deepep ({why})"
        logger.info(line)
        return torch_group
    assert hidden is not None and num_local_experts is not None
    chosen = DeepEPGroup(
        group,
        module,
        hidden=hidden,
        num_local_experts=num_local_experts,
        low_latency=low_latency,
        top_k=top_k,
        max_tokens_per_rank=max_tokens_per_rank,
        use_fp8=use_fp8,
    )
    logger.info("ep backend: %s", chosen.describe())
    return chosen
