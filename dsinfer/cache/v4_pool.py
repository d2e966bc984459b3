"""DeepSeek-V4's KV pool: pages of compressed entries and indexer keys, and each running
sequence's bounded rest.

A page stands for ``page_size`` tokens (256: a multiple of both compression rates) and holds, per
compressing layer, those tokens' compressed entries (CSA: and indexer keys): the groups that grow
with a sequence (dsinfer/base/kv_groups.py; dsinfer/model/v4_paged.py lays them out). What stays
bounded whatever a sequence's length, the window's last ``sliding_window - 1`` raw rows of every
layer and the compressors' unfinished rows, is the sequence's own state; the engine sets that aside
for ``max_num_seqs`` sequences, and as many prefix-cache resume points (dsinfer/model/v4_paged.py),
before it counts pages, and drops the states of sequences that stop running. The scheduler admits,
grows and preempts by pages as for V3, and shares cached pages between sequences. A page's record
(what the disk tier stores, ``read_page``/``write_page``) is its compressed groups and its resume
point, so a page read back after a restart can end a prefix hit.

PD: a transfer library registers one cache layer per model layer (its paged groups; none for a
sliding-window layer) and a last layer of handoff slots (dsinfer/cache/handoff_slots.py,
``max_num_seqs`` of them, made when the pool is first registered). A prefill rank sends a
prompt's whole pages and, in a slot, the resume point at the last of them; the decode rank
computes the prompt's last partial page itself from there (at most ``page_size - 1`` tokens), so
no per-sequence state crosses but a resume point.
"""

from __future__ import annotations

import struct

import torch

from dsinfer.base.kv_groups import V4_PAGE_TOKENS, HybridCacheSpec
from dsinfer.base.v4_config import V4Config
from dsinfer.cache.handoff_slots import HandoffSlots
from dsinfer.cache.kv_pool import PageAllocator, PagePool
from dsinfer.model.v4_paged import SequenceStates, resume_shapes
from dsinfer.model.v4_state import Boundary

_TAIL = struct.Struct("<q?")  # a record's resume point: its position, whether there is one


class V4StatePool(PagePool):
    sends_partial_pages = False  # a prompt's last partial page is computed again by the decode rank

    def __init__(
        self,
        config: V4Config,
        num_pages: int,
        dtype: torch.dtype,
        device: torch.device | str,
        *,
        max_resume_points: int = 0,
        handoff_slots: int = 0,
        mtp_layers: int = 0,
    ) -> None:
        self.spec = self.spec_for(config, dtype, mtp_layers)  # the MTP layers' windows: per sequence
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.page_size = self.spec.page_tokens
        self._device = torch.device(device)
        self.caches = SequenceStates(
            config, num_pages, self.page_size, dtype, self._device, max_resume_points, mtp_layers
        )
        self.allocator = PageAllocator(num_pages)
        self.num_layers = config.num_hidden_layers
        self.page_bytes = self.page_bytes_for(config, dtype)
        # a page's record: its groups, then room for a resume point (zero parts give the shapes)
        self._resume_blank = self.caches.resume_shapes()
        groups = [t[0] for t in self.caches.tensors()]
        self._resume_bytes = sum(t.nbytes for t in self._resume_blank)
        self.page_record_bytes = sum(t.nbytes for t in groups) + self._resume_bytes + _TAIL.size
        shapes = ", ".join(f"{tuple(t.shape)}" for t in groups + self._resume_blank)
        self.page_record_layout = f"{self.page_layout}; record {shapes} x {dtype} + resume point"
        self._handoff_count = handoff_slots
        self.handoff: HandoffSlots | None = None  # made by ``layer_tensors`` (a PD rank)

    @staticmethod
    def spec_for(config: V4Config, dtype: torch.dtype, mtp_layers: int = 0) -> HybridCacheSpec:
        return HybridCacheSpec.for_v4(config, str(dtype).removeprefix("torch."), V4_PAGE_TOKENS, mtp_layers)

    @classmethod
    def page_bytes_for(cls, config: V4Config, dtype: torch.dtype) -> int:
        return cls.spec_for(config, dtype).charged_page_bytes

    @staticmethod
    def handoff_slot_bytes_for(config: V4Config, dtype: torch.dtype, mtp_layers: int = 0) -> int:
        """One handoff slot: a resume point, its position and presence."""
        return sum(t.nbytes for t in resume_shapes(config, dtype, mtp_layers)) + _TAIL.size

    @classmethod
    def reserve_bytes_for(
        cls, config: V4Config, dtype: torch.dtype, max_num_seqs: int, mtp_layers: int = 0
    ) -> int:
        return cls.spec_for(config, dtype, mtp_layers).reserve_bytes(max_num_seqs)

    @property
    def page_layout(self) -> str:
        groups = ", ".join(
            f"{g.name}:{len(g.layers)}x{g.width}/{g.tokens_per_entry}" for g in self.spec.groups
        )
        return f"V4 hybrid, page {self.page_size}: {groups}"

    @property
    def device(self) -> torch.device:
        return self._device

    def describe(self) -> str:
        return self.page_layout

    # A page as a record (what the disk and host tiers store) -------------------------------------
    # page_record_bytes: its compressed groups, then room for its resume point (the window's rows
    # and CSA's overlap rows at its end), then the point's position and a presence byte
    def read_page(self, page: int, device: str | torch.device = "cpu") -> torch.Tensor:
        """A copy of ``page``'s record, uint8 ``[page_record_bytes]`` (no resume point: zeros)."""
        groups = [t[page].contiguous().view(torch.uint8).reshape(-1) for t in self.caches.tensors()]
        point = self._encode_point(self.caches.resume_point(page), self._device)
        return torch.cat([*groups, point]).to(device)

    def write_page(self, page: int, data: torch.Tensor) -> None:
        """Install a record ``read_page`` made: the groups into ``page``, its resume point if any."""
        if data.dtype != torch.uint8 or tuple(data.shape) != (self.page_record_bytes,):
            raise ValueError(
                f"page record is {data.dtype} {tuple(data.shape)}, expected uint8 ({self.page_record_bytes},)"
            )
        offset = 0
        for tensor in self.caches.tensors():
            target = tensor[page].view(torch.uint8)
            target.copy_(data[offset : offset + target.numel()].view(target.shape))
            offset += target.numel()
        point = self._decode_point(data[offset:])
        self.caches.forget([page])
        if point is not None:
            self.caches.install(page, point)

    def _encode_point(self, point: Boundary | None, device: torch.device) -> torch.Tensor:
        """A resume point as uint8 ``[resume bytes + tail]`` on ``device``: its parts (where they
        are), position, presence."""
        out = torch.zeros(self._resume_bytes + _TAIL.size, dtype=torch.uint8, device=device)
        if point is not None:
            parts = [*point.windows, *(t for pair in point.overlaps.values() for t in pair)]
            out[: self._resume_bytes] = torch.cat(
                [p.contiguous().view(torch.uint8).reshape(-1) for p in parts]
            )
        tail = _TAIL.pack(point.position if point is not None else 0, point is not None)
        out[self._resume_bytes :] = torch.tensor(list(tail), dtype=torch.uint8)
        return out

    def _decode_point(self, data: torch.Tensor) -> Boundary | None:
        position, present = _TAIL.unpack(bytes(data[self._resume_bytes :].tolist()))
        if not present:
            return None
        parts, offset = [], 0
        for like in self._resume_blank:
            raw = data[offset : offset + like.nbytes].clone()
            parts.append(raw.view(like.dtype).view(like.shape).to(self._device))
            offset += like.nbytes
        return self.caches.boundary_from(position, parts)

    # PD: what a transfer library registers and writes ---------------------------------------------
    def layer_tensors(self) -> list[tuple[torch.Tensor, ...]]:
        """Per model layer its paged groups (none for a sliding-window layer), then the handoff
        slots (made now: only a PD rank registers its pool)."""
        if self.handoff is None:
            if self._handoff_count <= 0:
                raise RuntimeError("this V4 pool has no handoff slots (handoff_slots=0): no KV transfer")
            slot_bytes = self.handoff_slot_bytes_for(
                self.caches.config, self.caches.dtype, self.caches.mtp_layers
            )
            self.handoff = HandoffSlots(self._handoff_count, slot_bytes, self._device)
            self.caches.max_resume_points = max(self.caches.max_resume_points, self._handoff_count)
        groups = self.caches.groups
        per_layer = [tuple(t for t in groups.get(i, ()) if t is not None) for i in range(self.num_layers)]
        return [*per_layer, (self.handoff.tensor,)]

    def transfer_page_groups(self) -> list[dict[str, int]]:
        """Bytes of one page per registered layer, by cache group (``c4``/``c4_indexer``/``c128``;
        the slots' layer: one ``resume_point``)."""
        layer_tensors = self.layer_tensors()
        out: list[dict[str, int]] = []
        for layer in range(self.num_layers):  # its groups in the spec's order, that of its tensors
            names = [g.name for g in self.spec.groups if g.name != "window" and layer in g.layers]
            out.append({name: t[0].nbytes for name, t in zip(names, layer_tensors[layer], strict=True)})
        out.append({"resume_point": layer_tensors[-1][0][0].nbytes})
        return out

    def transfer_page_bytes(self) -> list[int]:
        """Bytes of one page per registered layer (the slots' layer: one slot)."""
        return [sum(groups.values()) for groups in self.transfer_page_groups()]

    @property
    def handoff_layer(self) -> int:
        return self.num_layers

    def stage_point(self, pages: list[int], num_tokens: int) -> tuple[int, int] | None:
        """Copy the resume point at the last whole page of a sequence's ``num_tokens`` into a
        free handoff slot: (slot, its position), or None when there is no such point (a prompt
        shorter than a page; prefix caching off) or no free slot."""
        whole = num_tokens // self.page_size
        point = self.caches.resume_point(pages[whole - 1]) if whole else None
        if point is None or point.position != whole * self.page_size or self.handoff is None:
            return None
        slot = self.handoff.take()
        if slot is not None:
            self.handoff.write(slot, self._encode_point(point, self._device))
        return None if slot is None else (slot, point.position)

    def adopt_point(self, slot: int, pages: list[int], position: int) -> None:
        """The resume point a prefill rank wrote into ``slot``: kept for the page that ends at
        ``position`` (the sequence resumes there); the slot is free again."""
        assert self.handoff is not None
        point = self._decode_point(self.handoff.read(slot))
        self.handoff.give(slot)
        if point is None or point.position != position:
            raise RuntimeError(f"V4 handoff slot {slot} holds no resume point at token {position}")
        self.caches.hand_over(pages[position // self.page_size - 1], point)
