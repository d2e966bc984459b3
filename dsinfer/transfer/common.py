"""What both backends share: the pool's page layout, the metadata peers exchange, page lists as
byte runs, the bookkeeping of one write handle, and ``PoolBackend``, the library-independent half
of a backend (pool, peers, handles).

A pool is registered as its cache layers, each zero or more tensors ``[pages, rows, dim]`` (the
layer's caches in the pool's spec order: MLA's latent, V3.2's indexer keys; see
dsinfer/base/kv_spec.py). A write of a layer's pages writes every cache of that layer. Layers may
differ (DeepSeek-V4's compressing layers hold their own groups, its sliding-window layers none,
and its pool adds a layer of resume-point slots): each has its own geometry and page count.

The metadata is one msgpack-encoded ``PoolMetadata``: the backend's own connection info
(``endpoint``: NIXL agent metadata or Mooncake's ``host:port``) plus, for every cache of every
layer, its base address, page stride and page count, and its geometry (rows per page, dtype and
values per row) that a writer must share with the pool it writes into.
"""

from __future__ import annotations

import logging
import time
from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import msgspec
import torch

from dsinfer.transfer.base import (
    TransferBackend,
    TransferError,
    TransferHandle,
    TransferState,
    TransferStats,
)

log = logging.getLogger("dsinfer.transfer")


class LayerRegion(msgspec.Struct, frozen=True, array_like=True):
    """One cache tensor of one layer."""

    addr: int
    page_stride: int  # bytes between the starts of two consecutive pages
    num_pages: int

    def extent(self, page_bytes: int) -> int:
        """Bytes from the first page's start to the last page's end."""
        return (self.num_pages - 1) * self.page_stride + page_bytes


class CacheGeometry(msgspec.Struct, frozen=True, array_like=True):
    """One cache of a layer: its dtype, rows (tokens) per page, values per row, bytes per page."""

    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"
    rows: int
    dim: int
    page_bytes: int


class PoolMetadata(msgspec.Struct, frozen=True, kw_only=True):
    backend: str
    agent: str
    device: str  # "cpu" or "cuda:<index>"
    geometry: list[list[CacheGeometry]]  # per layer, one per cache
    layers: list[list[LayerRegion]]  # per layer, one region per cache
    endpoint: bytes  # backend-specific connection info

    def page_bytes(self, layer: int) -> int:
        """Bytes of one page of ``layer``, over its caches."""
        return sum(c.page_bytes for c in self.geometry[layer])

    def spans(self) -> list[tuple[int, int]]:
        """(address, extent) of every registered region."""
        return [
            (r.addr, r.extent(c.page_bytes))
            for regions, caches in zip(self.layers, self.geometry, strict=True)
            for r, c in zip(regions, caches, strict=True)
        ]

    def describe(self) -> str:
        """The page geometry, once per distinct layer geometry."""
        kinds: dict[str, int] = {}
        for layer, caches in enumerate(self.geometry):
            text = _layer_text(caches, self.page_bytes(layer))
            kinds[text] = kinds.get(text, 0) + 1
        if len(kinds) == 1:
            return next(iter(kinds))
        return "; ".join(f"{n} layers of {text}" for text, n in kinds.items())


def _layer_text(caches: list[CacheGeometry], page_bytes: int) -> str:
    if not caches:
        return "no caches"
    rows = {c.rows for c in caches}
    if len(rows) == 1:
        inner = " + ".join(f"{c.dtype} x {c.dim}" for c in caches)
        return f"{rows.pop()} tokens x ({inner}) ({page_bytes} B per page per layer)"
    inner = " + ".join(f"{c.rows} x {c.dtype} x {c.dim}" for c in caches)
    return f"({inner}) ({page_bytes} B per page per layer)"


def describe_pool(backend: str, agent: str, layers: Sequence[Sequence[torch.Tensor]]) -> PoolMetadata:
    """A pool's metadata (its endpoint still empty), or TransferError if a cache is not
    ``[pages, rows, dim]`` with each page contiguous, a layer's caches differ in page count, or
    the caches are not on one device."""
    tensors = [t for caches in layers for t in caches]
    if not tensors:
        raise TransferError("register_pool needs at least one cache layer with at least one cache")
    device = tensors[0].device
    for i, caches in enumerate(layers):
        for t in caches:
            if t.dim() != 3:
                raise TransferError(
                    f"cache layer {i} has a cache of shape {tuple(t.shape)}, expected [pages, page_size, dim]"
                )
            num, rows, dim = t.shape
            if num == 0 or num != caches[0].shape[0]:
                raise TransferError(f"cache layer {i}: every cache needs the same pages (> 0)")
            if t.device != device:
                raise TransferError(
                    f"cache layer {i} is on {t.device}, layer 0 on {device}: one device per pool"
                )
            if t.stride(2) != 1 or t.stride(1) != dim or t.stride(0) < rows * dim:
                raise TransferError(f"cache layer {i} has strides {t.stride()}: each page must be contiguous")
    geometry = [
        [
            CacheGeometry(str(t.dtype).removeprefix("torch."), t.shape[1], t.shape[2], t[0].nbytes)
            for t in caches
        ]
        for caches in layers
    ]
    regions = [
        [LayerRegion(t.data_ptr(), t.stride(0) * t.element_size(), t.shape[0]) for t in caches]
        for caches in layers
    ]
    return PoolMetadata(
        backend=backend,
        agent=agent,
        device=device_name(device),
        geometry=geometry,
        layers=regions,
        endpoint=b"",
    )


def _pages(meta: PoolMetadata) -> int:
    """The page count of the pool's first layer with caches (its KV pages)."""
    return next(regions[0].num_pages for regions in meta.layers if regions)


def device_name(device: torch.device) -> str:
    return "cpu" if device.type == "cpu" else f"{device.type}:{device.index or 0}"


def encode_metadata(meta: PoolMetadata) -> bytes:
    return msgspec.msgpack.encode(meta)


def decode_metadata(peer_agent: str, data: bytes) -> PoolMetadata:
    try:
        return msgspec.msgpack.decode(data, type=PoolMetadata)
    except msgspec.DecodeError as e:
        raise TransferError(f"metadata of peer {peer_agent!r} is not dsinfer transfer metadata: {e}") from e


def check_compatible(local: PoolMetadata, remote: PoolMetadata, peer_agent: str) -> None:
    """Refuse a peer this rank cannot write into page for page."""
    if remote.agent != peer_agent:
        raise TransferError(f"metadata given for peer {peer_agent!r} belongs to agent {remote.agent!r}")
    if remote.backend != local.backend:
        raise TransferError(
            f"peer {peer_agent!r} uses transfer backend {remote.backend!r}, this rank {local.backend!r}"
        )
    if len(remote.layers) != len(local.layers):
        raise TransferError(
            f"peer {peer_agent!r} pool has {len(remote.layers)} cache layers, this rank's {len(local.layers)}"
        )
    if remote.geometry != local.geometry:
        raise TransferError(
            f"peer {peer_agent!r} pool pages are {remote.describe()}, this rank's are {local.describe()}"
        )


def page_runs(
    src_pages: list[int], dst_pages: list[int], src_limit: int, dst_limit: int, where: str
) -> list[tuple[int, int, int]]:
    """Bounds-checked (src_start, dst_start, count) runs: consecutive pairs where both page
    numbers step by one are merged."""
    if len(src_pages) != len(dst_pages):
        raise TransferError(f"{len(src_pages)} source pages but {len(dst_pages)} destination pages ({where})")
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_pages, dst_pages, strict=True):
        if not 0 <= s < src_limit:
            raise TransferError(f"source page {s} out of range [0, {src_limit}) ({where})")
        if not 0 <= d < dst_limit:
            raise TransferError(f"destination page {d} out of range [0, {dst_limit}) ({where})")
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def byte_runs(
    runs: list[tuple[int, int, int]], src: LayerRegion, dst: LayerRegion, page_bytes: int
) -> list[tuple[int, int, int]]:
    """(src_addr, dst_addr, nbytes) per run; a run is split into pages where a side has gaps
    between its pages."""
    dense = src.page_stride == page_bytes and dst.page_stride == page_bytes
    out: list[tuple[int, int, int]] = []
    for s, d, n in runs:
        if dense:
            out.append((src.addr + s * src.page_stride, dst.addr + d * dst.page_stride, n * page_bytes))
        else:
            out.extend(
                (src.addr + (s + i) * src.page_stride, dst.addr + (d + i) * dst.page_stride, page_bytes)
                for i in range(n)
            )
    return out


@dataclass(eq=False)
class WriteRecord(TransferHandle):
    """A write's bytes, start time and state; ``settle`` moves it to a final state once."""

    nbytes: int
    peer: str
    start: float = field(default_factory=time.perf_counter)
    state: TransferState = "pending"
    released: bool = False

    def settle(self, state: TransferState, stats: TransferStats) -> None:
        if self.state != "pending":
            return
        self.state = state
        if state == "done":
            stats.bytes_written += self.nbytes
            stats.seconds += time.perf_counter() - self.start
            stats.writes_done += 1
        else:
            stats.writes_failed += 1


@dataclass(frozen=True)
class Peer:
    meta: PoolMetadata
    raw: bytes  # the metadata as received: the same bytes again make ``connect`` a no-op


PeerT = TypeVar("PeerT", bound=Peer)
WriteT = TypeVar("WriteT", bound=WriteRecord)


class PoolBackend(TransferBackend, Generic[PeerT, WriteT]):
    """A backend's bookkeeping and checks; subclasses add the library calls."""

    label: str  # the library, as messages name it
    write_type: type[WriteT]

    def __init__(self, agent_name: str) -> None:
        super().__init__(agent_name)
        self._caches: list[tuple[torch.Tensor, ...]] = []  # kept alive while registered
        self._meta: PoolMetadata | None = None
        self._peers: dict[str, PeerT] = {}
        self._open: set[WriteT] = set()
        self._closed = False

    @abstractmethod
    def _register(self, pool: PoolMetadata) -> bytes:
        """Register the pool's layers with the library; the endpoint peers reach it at."""

    @abstractmethod
    def _open_peer(self, peer_agent: str, meta: PoolMetadata, raw: bytes, replacing: bool) -> PeerT:
        """Set up the library's side of a compatible peer (``replacing`` an older connection)."""

    @abstractmethod
    def _advance(self, rec: WriteT) -> None:
        """Move a pending write on, settling it if it ended."""

    @abstractmethod
    def _shutdown(self) -> None:
        """Drop open writes, peers and the pool's registration, then the library's handle."""

    def _address(self, meta: PoolMetadata) -> str:
        """Where a pool is reached, as log lines add it after the agent's name."""
        return ""

    def register_pool(self, layers: Sequence[Sequence[torch.Tensor]]) -> None:
        if self._meta is not None:
            raise TransferError(f"agent {self.agent_name!r} already registered a pool")
        pool = describe_pool(self.name, self.agent_name, layers)
        endpoint = self._register(pool)
        self._caches = [tuple(caches) for caches in layers]
        self._meta = meta = msgspec.structs.replace(pool, endpoint=endpoint)
        log.info(
            "%s agent %s%s registered %d cache layers x %d pages (%s, %s)",
            self.label,
            self.agent_name,
            self._address(meta),
            len(meta.layers),
            _pages(meta),
            meta.describe(),
            meta.device,
        )

    def metadata(self) -> bytes:
        return encode_metadata(self._local())

    def connect(self, peer_agent: str, peer_metadata: bytes) -> None:
        old = self._peers.get(peer_agent)
        if old is not None and old.raw == peer_metadata:
            return
        meta = decode_metadata(peer_agent, peer_metadata)
        check_compatible(self._local(), meta, peer_agent)
        self._peers[peer_agent] = self._open_peer(peer_agent, meta, peer_metadata, old is not None)
        log.info(
            "%s agent %s %s peer %s%s (%d layers x %d pages)",
            self.label,
            self.agent_name,
            "reconnected to" if old is not None else "connected to",
            peer_agent,
            self._address(meta),
            len(meta.layers),
            _pages(meta),
        )

    def _resolve(
        self, peer_agent: str, layer: int, src_pages: list[int], dst_pages: list[int]
    ) -> tuple[PeerT, list[tuple[int, int, int]], int]:
        """The connected peer, the write's (src_addr, dst_addr, nbytes) spans and its byte count,
        or TransferError for an unknown peer, a layer or page out of range."""
        local = self._local()
        peer = self._peers.get(peer_agent)
        if peer is None:
            raise TransferError(f"peer {peer_agent!r} is not connected (call connect first)")
        if not 0 <= layer < len(local.layers):
            raise TransferError(f"layer {layer} out of range [0, {len(local.layers)})")
        where = f"layer {layer} to peer {peer_agent!r}"
        if not local.layers[layer]:
            raise TransferError(f"layer {layer} has no caches: nothing to write ({where})")
        spans: list[tuple[int, int, int]] = []
        for src, dst, cache in zip(
            local.layers[layer], peer.meta.layers[layer], local.geometry[layer], strict=True
        ):
            runs = page_runs(src_pages, dst_pages, src.num_pages, dst.num_pages, where)
            spans += byte_runs(runs, src, dst, cache.page_bytes)
        return peer, spans, len(src_pages) * local.page_bytes(layer)

    def poll(self, handle: TransferHandle) -> TransferState:
        rec = self._own(handle)
        if rec.state == "pending":
            self._check_open()
            self._advance(rec)
        return rec.state

    def release(self, handle: TransferHandle) -> None:
        rec = self._own(handle)
        if rec.released:
            return
        if rec.state == "pending":
            raise TransferError("a pending write cannot be released (it cannot be cancelled): poll it first")
        self._drop(rec)

    def _drop(self, rec: WriteT) -> None:
        rec.released = True
        self._open.discard(rec)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._shutdown()
        self._caches = []
        log.info("%s agent %s closed", self.label, self.agent_name)

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"{self.label} agent {self.agent_name!r} is closed")

    def _local(self) -> PoolMetadata:
        self._check_open()
        if self._meta is None:
            raise TransferError(
                f"agent {self.agent_name!r} has no registered pool (call register_pool first)"
            )
        return self._meta

    def _own(self, handle: TransferHandle) -> WriteT:
        if not isinstance(handle, self.write_type):
            raise TransferError(f"{type(handle).__name__} is not a handle of the {self.label} backend")
        return handle
