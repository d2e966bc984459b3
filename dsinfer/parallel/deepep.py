"""DeepEP backend of :class:`~dsinfer.parallel.ep.EPGroup`.

UNVERIFIED: DeepEP cannot be installed on any machine this project is developed on, and one GPU
cannot run it (it needs two ranks or more). :class:`DeepEPGroup` is written against the documented
API of DeepEP's ``Buffer`` (in DeepEP v2 the same class is still exported as the "legacy" buffer)
and is only ever built by :func:`dsinfer.parallel.ep_select.make_ep_group` when ``import deep_ep``
works and the group is NCCL on CUDA. It has never run. The index bookkeeping and the sizes it
computes are pure functions in :mod:`dsinfer.parallel.deepep_layout`, held by the CPU tests.

Design: two levels, one model.

- Pair level (the ``EPGroup`` contract the MoE uses today, unchanged): every (token, expert)
  pair is one row. It maps onto DeepEP by making each pair row a DeepEP "token" routed top-1 to
  its physical expert ``dest_rank * num_local_experts + local_slot``. Normal mode: the row
  reaches exactly one rank, arrives with its local slot in ``recv_topk_idx``, and the unweighted
  combine returns it, alone, to its place in ``x``. Low-latency mode: the same top-1 routing in
  ``top_k`` rounds of at most ``max_tokens_per_rank`` rows each (every rank runs all rounds, empty
  ones included), the ``[E_local, R*T, H]`` receive layout compacted to rows by ``recv_count``
  (a host sync) and scattered back before a combine with weight 1. Correct and MoE-transparent,
  but a token with several experts on one rank travels once per pair, not once per rank.
- Token level (the efficient path, for the MoE to adopt later): :meth:`DeepEPGroup.dispatch_tokens`
  / :meth:`DeepEPGroup.combine_tokens` (normal) and :meth:`DeepEPGroup.low_latency_dispatch_tokens`
  / :meth:`DeepEPGroup.low_latency_combine_tokens` expose DeepEP's own semantics (a token once per
  destination rank with LOCAL expert ids and weights; unweighted combine in normal mode, weighted in
  low-latency mode). :meth:`DeepEPGroup.routed_experts` and :func:`routed_pairs` give both levels
  one signature, ``(x, topk_physical, topk_weights, compute) -> [T, H]`` weighted sums, so that
  the MoE can call one method on any group without forking.

Low-latency sizing is per token, as DeepEP intends: ``max_tokens_per_rank`` (the most tokens a
decode step of one rank carries: the engine's ``max_num_seqs``, doubled with MTP) sizes the RDMA
buffer (``get_low_latency_rdma_size_hint``) and the NVSHMEM queue-pair depth DeepEP asserts at
every call (``2 x (tokens + 1)``; ``NVSHMEM_QP_DEPTH`` is raised before the buffer is built when
DeepEP's default 1,024 is too small, and an operator's smaller value is refused).

Rank-invariance: every choice that changes which collectives run (DeepEP or the torch fallback,
pair or token level) is the same on every rank, or the pool would hang. Dtype, hidden size and
configuration are shared; whether a low-latency call fits the buffer is not (one rank may run a
recompute prefill while the others decode), so the pool's per-step agreement carries the largest
step's tokens (``StepVotes.step_tokens``, handed over by ``begin_step``) and every rank takes the
torch all-to-all on the same NCCL group when they exceed the buffer (a caller outside the model
runner gets an all-reduce of its row count per call instead). Non-bf16 activations (the float32
parity runs) go through the torch all-to-all too, with the same semantics. ``close`` destroys the
buffer, which DeepEP asks for before the process group is torn down.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

from dsinfer.parallel.deepep_buffer import (
    LOW_LATENCY_HIDDEN,
    LOW_LATENCY_MAX_TOPK,
    make_buffer,
    missing_buffer_api,
)
from dsinfer.parallel.deepep_layout import (
    FP8_GROUP,
    Compute,
    compute_received_tokens,
    dequantize_fp8_rows,
    expand_received,
    is_token_in_rank,
    pack_masked,
    pair_expert_ids,
    reduce_to_tokens,
    round_slices,
    routed_pairs,
    split_expert_ids,
    token_send_plan,
    unpack_masked,
)
from dsinfer.parallel.ep import DispatchHandle, EPGroup, TorchEPGroup, all_reduce_in_place

log = logging.getLogger("dsinfer.parallel")

__all__ = [
    "FP8_GROUP",
    "LOW_LATENCY_HIDDEN",
    "LOW_LATENCY_MAX_TOPK",
    "DeepEPGroup",
    "LowLatencyRecv",
    "compute_received_tokens",
    "dequantize_fp8_rows",
    "expand_received",
    "is_token_in_rank",
    "missing_buffer_api",
    "pack_masked",
    "pair_expert_ids",
    "reduce_to_tokens",
    "routed_pairs",
    "split_expert_ids",
    "token_send_plan",
    "unpack_masked",
]

# --- the adapter (UNVERIFIED) -----------------------------------------------------------------


@dataclass
class _NormalPairHandle(DispatchHandle):
    """Pair-level normal-mode handle; the torch fields are unused (empty)."""

    native: Any = None


@dataclass
class _LowLatencyRound:
    native: Any
    topk_idx: torch.Tensor
    flat_index: torch.Tensor
    rows: int


@dataclass
class _LowLatencyPairHandle(DispatchHandle):
    """Pair-level low-latency handle (one entry per round); the torch fields are unused (empty)."""

    rounds: list[_LowLatencyRound] = field(default_factory=list)


@dataclass
class LowLatencyRecv:
    """Token-level low-latency dispatch result (DeepEP's masked layout, as it comes).

    ``x`` is bf16 ``[E_local, R*T, H]`` or, with FP8, fp8 with ``scales`` fp32
    ``[E_local, R*T, H/128]`` (column-major in its last two dims); only the first
    ``recv_count[e]`` rows of expert e are valid. ``hook`` (with ``return_recv_hook``) must be
    called before the data is read. At most two of these may be alive at once (double buffer).
    """

    x: torch.Tensor
    scales: torch.Tensor | None
    recv_count: torch.Tensor
    handle: Any
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    hook: Callable[[], None] | None


class DeepEPGroup(EPGroup):
    """UNVERIFIED. Expert-parallel dispatch/combine through DeepEP's ``Buffer``.

    ``low_latency=False``: normal mode (prefill; NVLink/RDMA, SMs used for communication),
    buffers sized by the dispatch and combine configs' size hints for bf16 rows of ``hidden``.
    ``low_latency=True``: low-latency mode (decode; pure RDMA), RDMA buffer sized by
    ``Buffer.get_low_latency_rdma_size_hint`` for ``max_tokens_per_rank`` tokens, one QP per
    local expert, optional FP8 dispatch. Activations that are not bf16, and low-latency calls that
    do not fit on some rank, go through :class:`TorchEPGroup` on the same group.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        module: ModuleType,
        *,
        hidden: int,
        num_local_experts: int,
        low_latency: bool = False,
        top_k: int = 8,
        max_tokens_per_rank: int = 128,
        use_fp8: bool = True,
        num_sms: int | None = None,
    ) -> None:
        why = missing_buffer_api(module)
        if why is not None:
            raise ImportError(why)
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)
        self.hidden, self.num_local_experts = hidden, num_local_experts
        self.num_experts = num_local_experts * self.size
        self.low_latency, self.use_fp8 = low_latency, use_fp8
        self.top_k = top_k
        self.max_tokens_per_rank = max_tokens_per_rank
        self._step_tokens: int | None = None  # the pool's agreed bound for the current step
        self._torch = TorchEPGroup(group)
        self._topk_dtype = getattr(module, "topk_idx_t", torch.int64)
        self.buffer, self._explicit_destroy = make_buffer(
            module,
            self.group,
            self.size,
            hidden=hidden,
            num_experts=self.num_experts,
            low_latency=low_latency,
            max_tokens_per_rank=max_tokens_per_rank,
            num_sms=num_sms,
        )

    def close(self) -> None:
        """Release the buffer while the process group is still alive (call before destroying it)."""
        buffer, self.buffer = getattr(self, "buffer", None), None
        if buffer is not None and self._explicit_destroy:
            buffer.destroy()

    def describe(self) -> str:
        mode = "low-latency" + (" fp8" if self.use_fp8 else " bf16") if self.low_latency else "normal"
        return f"deepep {mode} (UNVERIFIED), {self.size} ranks x {self.num_local_experts} slots"

    # -- pair level: the EPGroup contract ------------------------------------------------------

    def dispatch(
        self, x: torch.Tensor, dest_rank: torch.Tensor, local_slot: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
        if x.dtype != torch.bfloat16:
            return self._torch.dispatch(x, dest_rank, local_slot)
        topk_idx = pair_expert_ids(dest_rank, local_slot, self.num_local_experts).to(self._topk_dtype)
        if self.low_latency:
            if not self.fits_everywhere(-(-x.shape[0] // self.top_k)):  # pair rows -> tokens
                return self._torch.dispatch(x, dest_rank, local_slot)
            return self._ll_pair_dispatch(x, topk_idx)
        recv_x, recv_idx, _, native = self._normal_dispatch(
            x, topk_idx, torch.ones(topk_idx.shape, device=x.device)
        )
        # top-1 to the hosting rank: every received row holds its local slot in column 0
        return recv_x, recv_idx[:, 0].to(torch.int64), _NormalPairHandle(_empty(x), [], [], native)

    def combine(self, y: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        if isinstance(handle, _LowLatencyPairHandle):
            outs, start = [], 0
            for part in handle.rounds:
                packed = pack_masked(
                    y[start : start + part.flat_index.shape[0]].to(torch.bfloat16),
                    part.flat_index,
                    self.num_local_experts,
                    self._capacity,
                )
                start += part.flat_index.shape[0]
                ones = torch.ones(part.topk_idx.shape, dtype=torch.float32, device=y.device)
                out, _, _ = self.buffer.low_latency_combine(packed, part.topk_idx, ones, part.native)
                outs.append(out[: part.rows])
            return torch.cat(outs).to(y.dtype)
        if isinstance(handle, _NormalPairHandle):
            out, _, _ = self.buffer.combine(y.to(torch.bfloat16).contiguous(), handle.native)
            return out.to(y.dtype)
        return self._torch.combine(y, handle)

    @property
    def _capacity(self) -> int:
        return self.max_tokens_per_rank * self.size  # rows per local expert in the masked layout (R * T)

    def begin_step(self, step_tokens: int) -> None:
        self._step_tokens = step_tokens

    def fits_everywhere(self, tokens: int) -> bool:
        """Whether every rank's tokens fit the low-latency buffer, the same answer on every rank (all
        take the low-latency path or all the torch fallback): from the step's agreement
        (``begin_step``, the per-step all-reduce) when the model runner gave it, else by an
        all-reduce (max) of this call's ``tokens``."""
        if self._step_tokens is not None:
            return self._step_tokens <= self.max_tokens_per_rank
        count = torch.tensor(
            [tokens], dtype=torch.int64, device=torch.device("cuda", torch.cuda.current_device())
        )
        all_reduce_in_place(count, "max", self.group)
        return int(count.item()) <= self.max_tokens_per_rank

    def _ll_pair_dispatch(
        self, x: torch.Tensor, topk_idx: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
        self._check_ll(x, topk_idx)
        tokens = self.max_tokens_per_rank
        rows, slots, rounds = [], [], []
        for part in round_slices(x.shape[0], tokens, self.top_k):
            recv, recv_count, native, _, _ = self.buffer.low_latency_dispatch(
                x[part].contiguous(), topk_idx[part], tokens, self.num_experts, use_fp8=self.use_fp8
            )
            flat_index, part_slots = unpack_masked(recv_count, self._capacity)
            if self.use_fp8:
                q, scales = recv
                got = dequantize_fp8_rows(
                    q.reshape(-1, self.hidden)[flat_index], scales.reshape(-1, scales.shape[-1])[flat_index]
                ).to(x.dtype)
            else:
                got = recv.reshape(-1, self.hidden)[flat_index]
            rows.append(got)
            slots.append(part_slots)
            rounds.append(_LowLatencyRound(native, topk_idx[part], flat_index, part.stop - part.start))
        handle = _LowLatencyPairHandle(_empty(x), [], [], rounds)
        return torch.cat(rows), torch.cat(slots), handle

    def _check_ll(self, x: torch.Tensor, topk_idx: torch.Tensor) -> None:
        if x.shape[-1] != self.hidden:
            raise ValueError(f"DeepEP low-latency buffer is for hidden {self.hidden}, got {x.shape[-1]}")
        if topk_idx.shape[1] > LOW_LATENCY_MAX_TOPK:
            raise ValueError(
                f"DeepEP low-latency takes top-k <= {LOW_LATENCY_MAX_TOPK}, got {topk_idx.shape[1]}"
            )

    def _normal_dispatch(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]:
        per_rank, per_rdma_rank, per_expert, in_rank, _ = self.buffer.get_dispatch_layout(
            topk_idx, self.num_experts
        )
        recv_x, recv_idx, recv_weights, _, native, _ = self.buffer.dispatch(
            x.contiguous(),
            num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
            topk_idx=topk_idx,
            topk_weights=topk_weights.to(torch.float32),
        )
        return recv_x, recv_idx, recv_weights, native

    # -- token level: DeepEP's own semantics ---------------------------------------------------

    def dispatch_tokens(
        self, x: torch.Tensor, topk_idx_physical: torch.Tensor, topk_weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]:
        """Normal mode: ``x`` bf16 ``[T, H]`` to every rank hosting one of its experts, once per rank.

        -> ``(recv_x [M, H], recv_local_ids [M, k] (-1 = elsewhere), recv_weights [M, k] (0 there),
        handle)``, rows grouped by source rank then token order (:func:`token_send_plan`).
        """
        self._need(x, low_latency=False)
        recv_x, ids, weights, native = self._normal_dispatch(
            x, topk_idx_physical.to(self._topk_dtype), topk_weights
        )
        return recv_x, ids.to(torch.int64), weights, native

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return all_reduce_in_place(tensor, op, self.group)

    def combine_tokens(self, y_weighted: torch.Tensor, handle: Any) -> torch.Tensor:
        """Normal mode: received tokens' already weighted results ``[M, H]`` -> UNWEIGHTED sum per
        original token over the ranks it went to, ``[T, H]`` in x's order."""
        self._need(y_weighted, low_latency=False, dtype=False)
        out, _, _ = self.buffer.combine(y_weighted.to(torch.bfloat16).contiguous(), handle)
        return out

    def low_latency_dispatch_tokens(
        self,
        x: torch.Tensor,
        topk_idx_physical: torch.Tensor,
        topk_weights: torch.Tensor,
        *,
        use_fp8: bool | None = None,
        return_recv_hook: bool = False,
    ) -> LowLatencyRecv:
        """Low-latency mode: tokens ``[T <= max_tokens_per_rank, H]`` into the masked layout (the
        caller has checked, with :meth:`fits_everywhere`, that every rank's tokens fit)."""
        self._need(x, low_latency=True)
        fp8 = self.use_fp8 if use_fp8 is None else use_fp8
        topk_idx = topk_idx_physical.to(self._topk_dtype)
        self._check_ll(x, topk_idx)
        if x.shape[0] > self.max_tokens_per_rank:
            raise ValueError(
                f"{x.shape[0]} tokens exceed the low-latency buffer's {self.max_tokens_per_rank} per rank"
            )
        recv, recv_count, native, _, hook = self.buffer.low_latency_dispatch(
            x.contiguous(),
            topk_idx,
            self.max_tokens_per_rank,
            self.num_experts,
            use_fp8=fp8,
            return_recv_hook=return_recv_hook,
        )
        data, scales = recv if fp8 else (recv, None)
        return LowLatencyRecv(
            data,
            scales,
            recv_count,
            native,
            topk_idx,
            topk_weights.to(torch.float32),
            hook if return_recv_hook else None,
        )

    def low_latency_combine_tokens(
        self, y: torch.Tensor, recv: LowLatencyRecv, *, return_recv_hook: bool = False
    ) -> tuple[torch.Tensor, Callable[[], None] | None]:
        """Low-latency mode: per-expert results bf16 ``[E_local, R*T, H]`` -> WEIGHTED sum over each
        token's top-k, ``[T, H]`` (valid after ``hook()`` when ``return_recv_hook``)."""
        out, _, hook = self.buffer.low_latency_combine(
            y.to(torch.bfloat16),
            recv.topk_idx,
            recv.topk_weights,
            recv.handle,
            return_recv_hook=return_recv_hook,
        )
        return out, (hook if return_recv_hook else None)

    def routed_experts(
        self, x: torch.Tensor, topk_physical: torch.Tensor, topk_weights: torch.Tensor, compute: Compute
    ) -> torch.Tensor:
        """``sum_j w[t, j] * expert_{topk_physical[t, j]}(x[t])`` for every token, ``[T, H]``, through the
        token-level path (same signature and result as :func:`routed_pairs`)."""
        if x.dtype != torch.bfloat16 or (self.low_latency and not self.fits_everywhere(x.shape[0])):
            return routed_pairs(self._torch, x, topk_physical, topk_weights, compute, self.num_local_experts)
        if not self.low_latency:
            recv_x, ids, weights, handle = self.dispatch_tokens(x, topk_physical, topk_weights)
            return self.combine_tokens(compute_received_tokens(recv_x, ids, weights, compute), handle)
        recv = self.low_latency_dispatch_tokens(x, topk_physical, topk_weights)
        flat_index, slots = unpack_masked(recv.recv_count, self._capacity)
        if recv.scales is not None:
            rows = dequantize_fp8_rows(
                recv.x.reshape(-1, self.hidden)[flat_index],
                recv.scales.reshape(-1, recv.scales.shape[-1])[flat_index],
            ).to(x.dtype)
        else:
            rows = recv.x.reshape(-1, self.hidden)[flat_index]
        y = pack_masked(compute(rows, slots), flat_index, self.num_local_experts, self._capacity)
        out, _ = self.low_latency_combine_tokens(y, recv)
        return out.to(x.dtype)

    def _need(self, x: torch.Tensor, *, low_latency: bool, dtype: bool = True) -> None:
        mode = "low-latency" if low_latency else "normal"
        if self.low_latency != low_latency:
            raise RuntimeError(f"this DeepEP group was built for the other mode, not {mode}")
        if dtype and x.dtype != torch.bfloat16:
            raise TypeError(f"DeepEP {mode} token-level dispatch takes bf16 activations, got {x.dtype}")


def _empty(x: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.int64, device=x.device)
