"""Expert-parallel dispatch and combine: rows go to the rank hosting their expert slot and back.

``dispatch(x, dest_rank, local_slot)`` sends row i of ``x`` (with its slot index on the
receiving rank) to ``dest_rank[i]`` and returns what this rank received, grouped by source rank;
``combine(y, handle)`` sends the received rows' results back and returns them in the order of
the original ``x``. Every rank of the group must call both, in the same order, once per MoE
layer of every forward, also with zero rows (the collectives must line up). The torch backend
uses ``all_to_all_single`` with uneven splits (gloo on CPU, NCCL on GPU); DeepEP's normal and
low-latency kernels have the same contract (dsinfer/ops/external.py style adapters, later).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.distributed as dist

# gloo moves bytes; 16-bit floats travel as int16 (gloo's all_to_all does not take every dtype)
_WIRE_DTYPES = {torch.bfloat16: torch.int16, torch.float16: torch.int16}


@dataclass
class DispatchHandle:
    order: torch.Tensor  # the permutation that grouped the sent rows by destination rank
    send_counts: list[int]
    recv_counts: list[int]


class EPGroup(ABC):
    rank: int
    size: int

    @abstractmethod
    def dispatch(
        self, x: torch.Tensor, dest_rank: torch.Tensor, local_slot: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
        """-> (received rows [M, H], their local slots [M], handle for combine)."""

    @abstractmethod
    def combine(self, y: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """Results of the received rows [M, H] -> results of the sent rows [N, H], in x's order."""

    @abstractmethod
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In place over the group; ``op`` is "sum", "min" or "max"."""


class TorchEPGroup(EPGroup):
    """All-to-all over a torch.distributed process group (the default group when None)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    def dispatch(
        self, x: torch.Tensor, dest_rank: torch.Tensor, local_slot: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
        order = torch.argsort(dest_rank, stable=True)
        send = torch.bincount(dest_rank, minlength=self.size).to(torch.int64)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        handle = DispatchHandle(order, send.tolist(), recv.tolist())
        rows = self._exchange(x[order], handle.recv_counts, handle.send_counts)
        slots = self._exchange(local_slot[order], handle.recv_counts, handle.send_counts)
        return rows, slots, handle

    def combine(self, y: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        back = self._exchange(y, handle.send_counts, handle.recv_counts)
        out = torch.empty_like(back)
        out[handle.order] = back
        return out

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        ops = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
        dist.all_reduce(tensor, op=ops[op], group=self.group)
        return tensor

    def _exchange(self, data: torch.Tensor, out_counts: list[int], in_counts: list[int]) -> torch.Tensor:
        wire = _WIRE_DTYPES.get(data.dtype)
        send = data.contiguous() if wire is None else data.contiguous().view(wire)
        out = send.new_empty((sum(out_counts), *send.shape[1:]))
        dist.all_to_all_single(out, send, out_counts, in_counts, group=self.group)
        return out if wire is None else out.view(data.dtype)
