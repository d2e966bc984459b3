"""KV transfer over Mooncake Transfer Engine (P2P handshake, TCP by default).

Each coalesced page run is one ``transfer_submit_write`` (non-blocking): the Python API has no
non-blocking status of a multi-request batch (``get_batch_transfer_status`` waits). Mooncake's
TCP transport queues at most 1024 requests per peer (``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER``)
and fails the rest, so at most ``max_in_flight`` runs per peer are submitted at a time; the others
wait here, in order, and go out as ``poll`` sees earlier ones finish. A write is done when all its
runs completed, failed once none is left in flight and one of them failed. The peer is addressed
by its ``host:rpc_port``; Mooncake caches a peer's segment by that name, so a restarted peer must
come back on a new port (an ephemeral one always does).

"done" means the pages are in the peer's memory only with acknowledged TCP framing, which
Mooncake has from 0.3.12 (PR #2850: the target acknowledges a WRITE after its last chunk is in
destination memory; before, COMPLETED meant "in the local socket buffer"). Older versions, and
``MC_TCP_PROTO=1`` which forces the old framing, are refused.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import re
from collections import deque
from dataclasses import dataclass, field

import torch
from mooncake.engine import TransferEngine

from dsinfer.transfer.base import TransferBackend, TransferError, TransferHandle, TransferState
from dsinfer.transfer.common import (
    PoolMetadata,
    WriteRecord,
    byte_runs,
    check_compatible,
    decode_metadata,
    describe_pool,
    device_name,
    encode_metadata,
    page_runs,
)

log = logging.getLogger("dsinfer.transfer")

ACKED_TCP_SINCE = (0, 3, 12)
_DISTRIBUTIONS = ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine")
_DONE = 1  # transfer_check_status: 1 done, 0 in flight, -1 failed, -2 timed out


def _installed_version() -> str | None:
    for dist in _DISTRIBUTIONS:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def check_acked_tcp() -> None:
    if os.environ.get("MC_TCP_PROTO") == "1":
        raise TransferError(
            "MC_TCP_PROTO=1 forces Mooncake's unacknowledged TCP framing (a write may complete "
            "before it lands): unset it"
        )
    version = _installed_version()
    match = re.match(r"(\d+)\.(\d+)\.(\d+)", version or "")
    if match is None:
        log.warning("Mooncake version unknown (%s): assuming acknowledged TCP writes", version)
    elif tuple(int(g) for g in match.groups()) < ACKED_TCP_SINCE:
        raise TransferError(
            f"Mooncake {version} completes TCP writes before they land: "
            f"pip install -U 'mooncake-transfer-engine-non-cuda>={'.'.join(map(str, ACKED_TCP_SINCE))}'"
        )


@dataclass(eq=False)
class _MooncakeWrite(WriteRecord):
    endpoint: str = ""
    waiting: int = 0  # runs queued here, not yet submitted
    in_flight: int = 0
    failed: bool = False


@dataclass
class _Lane:
    """Runs to one peer endpoint: submitted ones (batch id, write) and those waiting for a slot."""

    submitted: list[tuple[int, _MooncakeWrite]] = field(default_factory=list)
    waiting: deque[tuple[_MooncakeWrite, int, int, int]] = field(default_factory=deque)


@dataclass(frozen=True)
class _Peer:
    meta: PoolMetadata
    raw: bytes
    endpoint: str


class MooncakeBackend(TransferBackend):
    name = "mooncake"

    def __init__(
        self,
        agent_name: str,
        *,
        host: str = "127.0.0.1",
        protocol: str = "tcp",
        device: str = "",
        max_in_flight: int = 256,
    ) -> None:
        super().__init__(agent_name)
        self._max_in_flight = max_in_flight
        if protocol == "tcp":
            check_acked_tcp()
        self._engine = TransferEngine()
        rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, device)
        if rc != 0:
            raise TransferError(
                f"Mooncake TransferEngine.initialize({host!r}, P2PHANDSHAKE, {protocol!r}) -> {rc}"
            )
        self._host = host
        self._caches: list[torch.Tensor] = []
        self._meta: PoolMetadata | None = None
        self._peers: dict[str, _Peer] = {}
        self._lanes: dict[str, _Lane] = {}  # by endpoint: writes to a replaced peer still drain
        self._open: set[_MooncakeWrite] = set()
        self._closed = False

    # Registration and peers --------------------------------------------------------------------
    def register_pool(self, caches: list[torch.Tensor]) -> None:
        if self._meta is not None:
            raise TransferError(f"agent {self.agent_name!r} already registered a pool")
        dtype, page_size, dim, page_bytes, device, regions = describe_pool(caches)
        for i, r in enumerate(regions):
            rc = self._engine.register_memory(r.addr, (r.num_pages - 1) * r.page_stride + page_bytes)
            if rc != 0:
                raise TransferError(f"Mooncake could not register cache layer {i} -> {rc}")
        self._caches = list(caches)
        endpoint = f"{self._host}:{self._engine.get_rpc_port()}"
        self._meta = PoolMetadata(
            backend=self.name,
            agent=self.agent_name,
            dtype=dtype,
            page_size=page_size,
            dim=dim,
            page_bytes=page_bytes,
            device=device_name(device),
            layers=regions,
            endpoint=endpoint.encode(),
        )
        log.info(
            "Mooncake agent %s at %s registered %d cache layers x %d pages (%s)",
            self.agent_name,
            endpoint,
            len(regions),
            regions[0].num_pages,
            self._meta.geometry(),
        )

    def metadata(self) -> bytes:
        return encode_metadata(self._local())

    def connect(self, peer_agent: str, peer_metadata: bytes) -> None:
        old = self._peers.get(peer_agent)
        if old is not None and old.raw == peer_metadata:
            return
        meta = decode_metadata(peer_agent, peer_metadata)
        check_compatible(self._local(), meta, peer_agent)
        endpoint = meta.endpoint.decode()
        self._peers[peer_agent] = _Peer(meta, peer_metadata, endpoint)
        log.info(
            "Mooncake agent %s %s peer %s at %s (%d layers x %d pages)",
            self.agent_name,
            "reconnected to" if old is not None else "connected to",
            peer_agent,
            endpoint,
            len(meta.layers),
            meta.layers[0].num_pages,
        )

    # Writes ------------------------------------------------------------------------------------
    def write_pages(
        self, peer_agent: str, layer: int, src_pages: list[int], dst_pages: list[int]
    ) -> TransferHandle:
        local = self._local()
        peer = self._peers.get(peer_agent)
        if peer is None:
            raise TransferError(f"peer {peer_agent!r} is not connected (call connect first)")
        if not 0 <= layer < len(local.layers):
            raise TransferError(f"layer {layer} out of range [0, {len(local.layers)})")
        src, dst = local.layers[layer], peer.meta.layers[layer]
        where = f"layer {layer} to peer {peer_agent!r}"
        runs = page_runs(src_pages, dst_pages, src.num_pages, dst.num_pages, where)
        spans = byte_runs(runs, src, dst, local.page_bytes)
        rec = _MooncakeWrite(
            nbytes=len(src_pages) * local.page_bytes, peer=peer_agent, endpoint=peer.endpoint
        )
        self._open.add(rec)
        lane = self._lanes.setdefault(peer.endpoint, _Lane())
        lane.waiting.extend((rec, src_addr, dst_addr, nbytes) for src_addr, dst_addr, nbytes in spans)
        rec.waiting = len(spans)
        self._progress(peer.endpoint)
        if rec.waiting == rec.in_flight == 0:
            rec.settle("failed" if rec.failed else "done", self.stats)
        return rec

    def poll(self, handle: TransferHandle) -> TransferState:
        rec = self._own(handle)
        if rec.state == "pending":
            if self._closed:
                raise TransferError(f"Mooncake agent {self.agent_name!r} is closed")
            self._progress(rec.endpoint)
        return rec.state

    def release(self, handle: TransferHandle) -> None:
        rec = self._own(handle)
        if rec.released:
            return
        if rec.state == "pending":
            raise TransferError("a pending write cannot be released (it cannot be cancelled): poll it first")
        rec.released = True
        self._open.discard(rec)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if any(rec.state == "pending" for rec in self._open):
            log.warning("Mooncake agent %s closing with writes in flight", self.agent_name)
        self._open.clear()
        self._peers.clear()
        self._lanes.clear()
        if self._meta is not None:
            for r in self._meta.layers:
                self._engine.unregister_memory(r.addr)
        self._caches = []
        del self._engine
        log.info("Mooncake agent %s closed", self.agent_name)

    # Helpers -----------------------------------------------------------------------------------
    def _local(self) -> PoolMetadata:
        if self._closed:
            raise TransferError(f"Mooncake agent {self.agent_name!r} is closed")
        if self._meta is None:
            raise TransferError(
                f"agent {self.agent_name!r} has no registered pool (call register_pool first)"
            )
        return self._meta

    def _own(self, handle: TransferHandle) -> _MooncakeWrite:
        if not isinstance(handle, _MooncakeWrite):
            raise TransferError(f"{type(handle).__name__} is not a handle of the Mooncake backend")
        return handle

    def _progress(self, endpoint: str) -> None:
        """Collect finished runs to ``endpoint``, submit waiting ones into the freed slots, and
        settle every write that has nothing left."""
        lane = self._lanes[endpoint]
        touched: set[_MooncakeWrite] = set()
        still: list[tuple[int, _MooncakeWrite]] = []
        for batch, rec in lane.submitted:
            status = self._engine.transfer_check_status(batch)
            if status == 0:
                still.append((batch, rec))
                continue
            rec.in_flight -= 1
            touched.add(rec)
            if status != _DONE:
                # a timed-out batch (status -2, only with MC_SLICE_TIMEOUT set) may still land later;
                # the decode side's quarantine covers that window
                log.warning("Mooncake write to %s at %s failed (status %d)", rec.peer, endpoint, status)
                self._fail(lane, rec)
        lane.submitted = still
        while lane.waiting and len(lane.submitted) < self._max_in_flight:
            rec, src_addr, dst_addr, nbytes = lane.waiting.popleft()
            rec.waiting -= 1
            touched.add(rec)
            batch = self._engine.transfer_submit_write(endpoint, src_addr, dst_addr, nbytes)
            if batch == 0:
                log.warning("Mooncake write to %s at %s failed to start", rec.peer, endpoint)
                self._fail(lane, rec)
                continue
            rec.in_flight += 1
            lane.submitted.append((batch, rec))
        for rec in touched:
            if rec.waiting == rec.in_flight == 0:
                rec.settle("failed" if rec.failed else "done", self.stats)

    @staticmethod
    def _fail(lane: _Lane, rec: _MooncakeWrite) -> None:
        """A failed run fails its write: the write's runs still waiting are never submitted."""
        rec.failed = True
        if rec.waiting:
            lane.waiting = deque(item for item in lane.waiting if item[0] is not rec)
            rec.waiting = 0
