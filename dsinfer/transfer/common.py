"""What both backends share: the pool's page layout, the metadata peers exchange, page lists as
byte runs, and the bookkeeping of one write handle.

The metadata is one msgpack-encoded ``PoolMetadata``: the backend's own connection info
(``endpoint``: NIXL agent metadata or Mooncake's ``host:port``) plus, for every cache layer, its
base address, page stride and page count, and the page geometry (dtype, tokens per page, values
per token) that a writer must share with the pool it writes into.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import msgspec
import torch

from dsinfer.transfer.base import TransferError, TransferHandle, TransferState, TransferStats


class LayerRegion(msgspec.Struct, frozen=True, array_like=True):
    addr: int
    page_stride: int  # bytes between the starts of two consecutive pages
    num_pages: int


class PoolMetadata(msgspec.Struct, frozen=True, kw_only=True):
    backend: str
    agent: str
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"
    page_size: int  # tokens per page
    dim: int  # values per token
    page_bytes: int
    device: str  # "cpu" or "cuda:<index>"
    layers: list[LayerRegion]
    endpoint: bytes  # backend-specific connection info

    def geometry(self) -> str:
        return f"{self.dtype} x {self.page_size} tokens x {self.dim} values ({self.page_bytes} B per page)"


def describe_pool(caches: list[torch.Tensor]) -> tuple[str, int, int, int, torch.device, list[LayerRegion]]:
    """(dtype, page_size, dim, page_bytes, device, regions) of a pool, or TransferError if the
    caches are not one page geometry on one device with each page contiguous in memory."""
    if not caches:
        raise TransferError("register_pool needs at least one cache layer")
    first = caches[0]
    for i, t in enumerate(caches):
        if t.dim() != 3:
            raise TransferError(
                f"cache layer {i} has shape {tuple(t.shape)}, expected [pages, page_size, dim]"
            )
        if t.shape[1:] != first.shape[1:] or t.dtype != first.dtype or t.device != first.device:
            raise TransferError(
                f"cache layer {i} is {t.dtype} {tuple(t.shape)} on {t.device}, layer 0 is "
                f"{first.dtype} {tuple(first.shape)} on {first.device}: one geometry per pool"
            )
        pages, page_size, dim = t.shape
        if pages == 0:
            raise TransferError(f"cache layer {i} has no pages")
        if t.stride(2) != 1 or t.stride(1) != dim or t.stride(0) < page_size * dim:
            raise TransferError(f"cache layer {i} has strides {t.stride()}: each page must be contiguous")
    _, page_size, dim = first.shape
    itemsize = first.element_size()
    regions = [LayerRegion(t.data_ptr(), t.stride(0) * itemsize, t.shape[0]) for t in caches]
    dtype = str(first.dtype).removeprefix("torch.")
    return dtype, page_size, dim, page_size * dim * itemsize, first.device, regions


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
    if (remote.dtype, remote.page_size, remote.dim, remote.page_bytes) != (
        local.dtype,
        local.page_size,
        local.dim,
        local.page_bytes,
    ):
        raise TransferError(
            f"peer {peer_agent!r} pool pages are {remote.geometry()}, this rank's are {local.geometry()}"
        )
    if len(remote.layers) != len(local.layers):
        raise TransferError(
            f"peer {peer_agent!r} pool has {len(remote.layers)} cache layers, this rank's {len(local.layers)}"
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
