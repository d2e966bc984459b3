"""Expert-parallel dispatch and combine: rows go to the rank hosting their expert slot and back.

``dispatch(x, dest_rank, local_slot)`` sends row i of ``x`` (with its slot index on the
receiving rank) to ``dest_rank[i]`` and returns what this rank received, grouped by source rank;
``combine(y, handle)`` sends the received rows' results back and returns them in the order of
the original ``x``. Every rank of the group must call both, in the same order, once per MoE
layer of every forward, also with zero rows (the collectives must line up). The torch backend
uses ``all_to_all_single`` with uneven splits (gloo on CPU, NCCL on GPU); DeepEP's normal and
low-latency kernels have the same contract (dsinfer/ops/external.py style adapters, later).

``dispatch_async`` / ``combine_async`` post the same exchanges and return a :class:`Pending` at
once, so that a micro-batch schedule computes while the data moves; ``Pending.wait()`` returns
what the synchronous call returns. The torch backend exchanges the row counts synchronously (a
few integers), then posts the data with ``async_op=True``; a backend without asynchronous
transfers inherits the fallback (the synchronous call, returned as a completed Pending). Every
rank must post and wait in the same order as the others post.
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")
Dispatched = tuple[torch.Tensor, torch.Tensor, "DispatchHandle"]


class Pending(Generic[T]):
    """A transfer in flight. Times are ``time.perf_counter_ns``: ``issued_ns`` when the call began
    (a synchronous preamble such as the counts exchange runs until ``posted_ns``), ``posted_ns``
    when the data was posted and ``completed_ns`` when it had arrived: set by the Works' future
    callbacks where the backend has them, else when ``wait`` returned. ``wait`` may be called more
    than once."""

    def __init__(
        self, works: list[dist.Work], finish: Callable[[], T], posted_ns: int, issued_ns: int | None = None
    ) -> None:
        self.posted_ns = posted_ns
        self.issued_ns = posted_ns if issued_ns is None else issued_ns
        self.completed_ns: int | None = None
        self._works, self._finish = works, finish
        self._done: list[int] = []
        self._result: tuple[T] | None = None
        for work in works:
            try:
                future = work.get_future()
            except RuntimeError:  # a backend without Work futures: the wait timestamps completion
                continue
            future.add_done_callback(self._on_done)

    @classmethod
    def completed(cls, value: T) -> Pending[T]:
        """A transfer that already happened (synchronous backends, no communication at all)."""
        now = time.perf_counter_ns()
        pending = cls([], lambda: value, now)
        pending.completed_ns = now
        return pending

    def _on_done(self, _future: torch.futures.Future) -> None:
        self._done.append(time.perf_counter_ns())  # runs on the backend's thread
        if len(self._done) == len(self._works) and self.completed_ns is None:
            self.completed_ns = max(self._done)

    @property
    def is_completed(self) -> bool:
        return self.completed_ns is not None

    def wait(self) -> T:
        if self._result is None:
            for work in self._works:
                work.wait()
            if self.completed_ns is None:
                self.completed_ns = time.perf_counter_ns()
            self._result = (self._finish(),)
        return self._result[0]


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

    def dispatch_async(
        self, x: torch.Tensor, dest_rank: torch.Tensor, local_slot: torch.Tensor
    ) -> Pending[Dispatched]:
        """``dispatch`` posted; this fallback runs it synchronously."""
        return Pending.completed(self.dispatch(x, dest_rank, local_slot))

    def combine_async(self, y: torch.Tensor, handle: DispatchHandle) -> Pending[torch.Tensor]:
        """``combine`` posted; this fallback runs it synchronously."""
        return Pending.completed(self.combine(y, handle))

    def begin_step(self, step_tokens: int) -> None:  # noqa: B027 - optional hook
        """The pool agreed that no rank's step carries more than ``step_tokens`` tokens."""

    def close(self) -> None:  # noqa: B027 - optional hook, most groups hold nothing to release
        """Release communication buffers; called before the process group is destroyed."""


class UnformedEPGroup(EPGroup):
    """A rank's seat in a pool group it has not joined yet: a restarted rank loads the experts
    of its rank ``rank`` of ``size`` before it rejoins its pool (elastic EP), then its engine
    regroups onto the real group. Every collective raises until then."""

    def __init__(self, rank: int, size: int) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} not in [0, {size})")
        self.rank, self.size = rank, size

    def _unformed(self) -> RuntimeError:
        return RuntimeError(f"rank {self.rank} of {self.size} has not joined its pool's group yet")

    def dispatch(
        self, x: torch.Tensor, dest_rank: torch.Tensor, local_slot: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
        raise self._unformed()

    def combine(self, y: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        raise self._unformed()

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        raise self._unformed()


class TorchEPGroup(EPGroup):
    """All-to-all over a torch.distributed process group (the default group when None)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    def dispatch(
        self, x: torch.Tensor, dest_rank: torch.Tensor, local_slot: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
        return self.dispatch_async(x, dest_rank, local_slot).wait()

    def combine(self, y: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        return self.combine_async(y, handle).wait()

    def dispatch_async(
        self, x: torch.Tensor, dest_rank: torch.Tensor, local_slot: torch.Tensor
    ) -> Pending[Dispatched]:
        issued = time.perf_counter_ns()
        order = torch.argsort(dest_rank, stable=True)
        send = torch.bincount(dest_rank, minlength=self.size).to(torch.int64)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        handle = DispatchHandle(order, send.tolist(), recv.tolist())
        posted = time.perf_counter_ns()
        # one transfer: each row's bytes with its slot's 8 bytes appended
        row_bytes = _as_bytes(x[order])
        packed = torch.cat([row_bytes, _as_bytes(local_slot[order].to(torch.int64))], dim=1)
        transfer = self._post(packed, handle.recv_counts, handle.send_counts)
        width = row_bytes.shape[1]

        def finish() -> Dispatched:
            got = transfer.out
            rows = _from_bytes(got[:, :width], x.dtype, x.shape[1:])
            return rows, _from_bytes(got[:, width:], torch.int64, ()), handle

        return Pending([transfer.work], finish, posted, issued)

    def combine_async(self, y: torch.Tensor, handle: DispatchHandle) -> Pending[torch.Tensor]:
        posted = time.perf_counter_ns()
        transfer = self._post(_as_bytes(y), handle.send_counts, handle.recv_counts)

        def finish() -> torch.Tensor:
            received = _from_bytes(transfer.out, y.dtype, y.shape[1:])
            out = torch.empty_like(received)
            out[handle.order] = received
            return out

        return Pending([transfer.work], finish, posted)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return all_reduce_in_place(tensor, op, self.group)

    def _post(self, data: torch.Tensor, out_counts: list[int], in_counts: list[int]) -> _Posted:
        """Post one uneven all-to-all of ``data``'s rows (bytes)."""
        out = data.new_empty((sum(out_counts), *data.shape[1:]))
        work = dist.all_to_all_single(out, data, out_counts, in_counts, group=self.group, async_op=True)
        assert work is not None
        return _Posted(work, data, out)


@dataclass
class _Posted:
    work: dist.Work
    send: torch.Tensor  # held until the transfer completes
    out: torch.Tensor  # the receive buffer


REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}


def all_reduce_in_place(tensor: torch.Tensor, op: str, group: dist.ProcessGroup | None) -> torch.Tensor:
    """All-reduce ``tensor`` over ``group`` in place and return it. NCCL reduces device memory
    only, so on an NCCL group a host tensor (load counters, agreement flags) makes the round trip
    through the rank's current GPU."""
    if op not in REDUCE_OPS:
        raise ValueError(f"unknown reduce op {op!r}; choose from {list(REDUCE_OPS)}")
    if tensor.is_cuda or dist.get_backend(group) != "nccl":
        dist.all_reduce(tensor, op=REDUCE_OPS[op], group=group)
        return tensor
    on_device = tensor.to(torch.device("cuda", torch.cuda.current_device()))
    dist.all_reduce(on_device, op=REDUCE_OPS[op], group=group)
    return tensor.copy_(on_device)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """Rows of ``t`` as uint8 rows [N, bytes] (gloo's all-to-all does not take every dtype)."""
    return t.reshape(t.shape[0], math.prod(t.shape[1:])).contiguous().view(torch.uint8)


def _from_bytes(b: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
    return b.contiguous().view(dtype).view(b.shape[0], *shape)
