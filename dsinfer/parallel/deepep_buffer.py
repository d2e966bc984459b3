"""DeepEP's ``Buffer`` as a pool builds it: the API it must have, and its sizes.

UNVERIFIED (as dsinfer/parallel/deepep.py): written against DeepEP's documented ``Buffer``.
Normal mode (prefill) takes the larger of the dispatch and combine configs' size hints for bf16
rows of ``hidden``; low-latency mode (decode) sizes its RDMA buffer per token
(``get_low_latency_rdma_size_hint`` for ``max_tokens_per_rank``), one queue pair per local expert,
and raises ``NVSHMEM_QP_DEPTH`` before the buffer initialises NVSHMEM when DeepEP's default is
too small for that many tokens (an operator's smaller value is refused).
"""

from __future__ import annotations

import inspect
import logging
import os
from types import ModuleType
from typing import Any

import torch.distributed as dist

from dsinfer.parallel.deepep_layout import qp_depth_to_set

log = logging.getLogger("dsinfer.parallel")

# Hidden sizes DeepEP's low-latency kernels are compiled for (the union over releases; older builds
# lack 3072 and 6144, in which case the kernel's own assertion reports it).
LOW_LATENCY_HIDDEN: tuple[int, ...] = (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)
LOW_LATENCY_MAX_TOPK = 11
BYTE_ALIGN = 128  # Buffer sizes are multiples of 128 bytes
_BUFFER_METHODS = (
    "get_dispatch_layout",
    "dispatch",
    "combine",
    "low_latency_dispatch",
    "low_latency_combine",
)


def missing_buffer_api(module: ModuleType) -> str | None:
    """Why ``module`` (``deep_ep``) lacks the Buffer API used here, or None when it has it."""
    buffer = getattr(module, "Buffer", None)
    if buffer is None:  # v2 built without the legacy buffer exports Buffer = None
        return f"{module.__name__}.Buffer is absent (v2 built without the legacy buffer)"
    missing = [name for name in _BUFFER_METHODS if not hasattr(buffer, name)]
    return f"{module.__name__}.Buffer lacks {missing[0]}" if missing else None


def make_buffer(
    module: ModuleType,
    group: dist.ProcessGroup,
    num_ranks: int,
    *,
    hidden: int,
    num_experts: int,
    low_latency: bool,
    max_tokens_per_rank: int,
    num_sms: int | None,
) -> tuple[Any, bool]:
    """The pool's buffer, and whether it must be destroyed explicitly (DeepEP warns that one
    released by its destructor can hang: ``DeepEPGroup.close`` destroys it)."""
    buffer_cls = module.Buffer
    if num_sms is not None:
        buffer_cls.set_num_sms(num_sms)  # class-level in DeepEP: set once, at pool start-up
    extra = {"explicitly_destroy": True} if _accepts(buffer_cls, "explicitly_destroy") else {}
    if not low_latency:
        nvl, rdma = normal_buffer_bytes(buffer_cls, num_ranks, hidden * 2)
        return buffer_cls(group, num_nvl_bytes=nvl, num_rdma_bytes=rdma, **extra), bool(extra)
    depth = qp_depth_to_set(max_tokens_per_rank, os.environ)
    if depth is not None:  # read by DeepEP when the buffer initialises NVSHMEM
        os.environ["NVSHMEM_QP_DEPTH"] = str(depth)
        log.info("NVSHMEM_QP_DEPTH=%d for %d tokens per rank", depth, max_tokens_per_rank)
    rdma = buffer_cls.get_low_latency_rdma_size_hint(max_tokens_per_rank, hidden, num_ranks, num_experts)
    buffer = buffer_cls(
        group,
        num_nvl_bytes=0,
        num_rdma_bytes=_align(rdma),
        low_latency_mode=True,
        num_qps_per_rank=num_experts // num_ranks,
        **extra,
    )
    return buffer, bool(extra)


def normal_buffer_bytes(buffer_cls: Any, num_ranks: int, hidden_bytes: int) -> tuple[int, int]:
    """(NVLink bytes, RDMA bytes) for normal mode: the larger of the dispatch and combine hints."""
    nvl = rdma = 0
    for config in (buffer_cls.get_dispatch_config(num_ranks), buffer_cls.get_combine_config(num_ranks)):
        nvl = max(nvl, config.get_nvl_buffer_size_hint(hidden_bytes, num_ranks))
        rdma = max(rdma, config.get_rdma_buffer_size_hint(hidden_bytes, num_ranks))
    return _align(nvl), _align(rdma)


def _align(n: int, to: int = BYTE_ALIGN) -> int:
    return -(-int(n) // to) * to


def _accepts(cls: Any, parameter: str) -> bool:
    """Whether ``cls(...)`` takes ``parameter`` (older DeepEP buffers lack some)."""
    try:
        return parameter in inspect.signature(cls).parameters
    except (TypeError, ValueError):  # a C extension without a signature
        return False
