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

from mooncake.engine import TransferEngine

from dsinfer.transfer.base import TransferError, TransferHandle, TransferStats
from dsinfer.transfer.common import Peer, PoolBackend, PoolMetadata, WriteRecord

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

    def settle_if_idle(self, stats: TransferStats) -> None:
        if self.waiting == self.in_flight == 0:
            self.settle("failed" if self.failed else "done", stats)


@dataclass
class _Lane:
    """Runs to one peer endpoint: submitted ones (batch id, write) and those waiting for a slot."""

    submitted: list[tuple[int, _MooncakeWrite]] = field(default_factory=list)
    waiting: deque[tuple[_MooncakeWrite, int, int, int]] = field(default_factory=deque)


@dataclass(frozen=True)
class _Peer(Peer):
    endpoint: str


class MooncakeBackend(PoolBackend[_Peer, _MooncakeWrite]):
    name = "mooncake"
    label = "Mooncake"
    write_type = _MooncakeWrite

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
        self._lanes: dict[str, _Lane] = {}  # by endpoint: writes to a replaced peer still drain

    # Registration and peers --------------------------------------------------------------------
    def _register(self, pool: PoolMetadata) -> bytes:
        for addr, extent in pool.spans():
            rc = self._engine.register_memory(addr, extent)
            if rc != 0:
                raise TransferError(f"Mooncake could not register the KV cache at {addr:#x} -> {rc}")
        return f"{self._host}:{self._engine.get_rpc_port()}".encode()

    def _open_peer(self, peer_agent: str, meta: PoolMetadata, raw: bytes, replacing: bool) -> _Peer:
        return _Peer(meta, raw, meta.endpoint.decode())

    def _address(self, meta: PoolMetadata) -> str:
        return f" at {meta.endpoint.decode()}"

    # Writes ------------------------------------------------------------------------------------
    def write_pages(
        self, peer_agent: str, layer: int, src_pages: list[int], dst_pages: list[int]
    ) -> TransferHandle:
        peer, spans, nbytes = self._resolve(peer_agent, layer, src_pages, dst_pages)
        rec = _MooncakeWrite(nbytes=nbytes, peer=peer_agent, endpoint=peer.endpoint)
        self._open.add(rec)
        lane = self._lanes.setdefault(peer.endpoint, _Lane())
        lane.waiting.extend((rec, src_addr, dst_addr, n) for src_addr, dst_addr, n in spans)
        rec.waiting = len(spans)
        self._progress(peer.endpoint)
        rec.settle_if_idle(self.stats)
        return rec

    def _advance(self, rec: _MooncakeWrite) -> None:
        self._progress(rec.endpoint)

    def _shutdown(self) -> None:
        if any(rec.state == "pending" for rec in self._open):
            log.warning("Mooncake agent %s closing with writes in flight", self.agent_name)
        self._open.clear()
        self._peers.clear()
        self._lanes.clear()
        if self._meta is not None:
            for addr, _ in self._meta.spans():
                self._engine.unregister_memory(addr)
        del self._engine

    # Helpers -----------------------------------------------------------------------------------
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
            rec.settle_if_idle(self.stats)

    @staticmethod
    def _fail(lane: _Lane, rec: _MooncakeWrite) -> None:
        """A failed run fails its write: the write's runs still waiting are never submitted."""
        rec.failed = True
        if rec.waiting:
            lane.waiting = deque(item for item in lane.waiting if item[0] is not rec)
            rec.waiting = 0
