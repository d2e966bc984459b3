"""KV transfer over NIXL (UCX): one NIXL agent per rank, one NIXL WRITE per ``write_pages`` call.

Caller mistakes (unknown peer, layer or page out of range) raise TransferError; a transport
failure while creating, posting or progressing a write (the peer died, the connection broke)
gives a handle in state "failed" instead, so the caller's in-flight bookkeeping sees every write
end through ``poll``.

"done" means the pages are in the peer's memory: NIXL's UCX backend ends every posted transfer
with ``ucp_ep_flush_nbx`` and reports the handle done only once that flush request completed
(ai-dynamo/nixl src/plugins/ucx/ucx_backend.cpp, ``sendXferRange``; the installed
libplugin_UCX.so imports ``ucp_ep_flush_nbx``), and UCP defines an endpoint flush as completing
every RMA operation issued before it "both at the origin and at the target". No NIXL notification
is attached: NIXL sends it only after that flush (nixl PR #252) but nothing on the receiving rank
reads notifications, so they would pile up in its agent.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from nixl_cu12._api import nixl_agent, nixl_agent_config

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


@dataclass(eq=False)
class _NixlWrite(WriteRecord):
    xfer: Any = None


@dataclass(frozen=True)
class _Peer:
    meta: PoolMetadata
    raw: bytes
    mem_type: str
    dev_id: int


def _mem(device: str) -> tuple[str, int]:
    """NIXL memory type and device id of a pool's device name."""
    if device == "cpu":
        return "DRAM", 0
    return "VRAM", int(device.partition(":")[2] or 0)


class NixlBackend(TransferBackend):
    name = "nixl"

    def __init__(self, agent_name: str) -> None:
        super().__init__(agent_name)
        try:
            # NIXL's progress thread busy-polls a whole core per agent even when idle; without
            # it, UCX makes progress when ``poll`` checks a transfer, which is all a writer needs.
            config = nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
            self._agent = nixl_agent(agent_name, config)
        except Exception as e:
            raise TransferError(f"cannot create NIXL agent {agent_name!r}: {e}") from e
        if "UCX" not in self._agent.backends:
            raise TransferError("NIXL has no UCX plugin here: reinstall nixl-cu12")
        self._caches: list[torch.Tensor] = []
        self._meta: PoolMetadata | None = None
        self._reg: Any = None
        self._peers: dict[str, _Peer] = {}
        self._open: set[_NixlWrite] = set()
        self._closed = False

    # Registration and peers --------------------------------------------------------------------
    def register_pool(self, caches: list[torch.Tensor]) -> None:
        if self._meta is not None:
            raise TransferError(f"agent {self.agent_name!r} already registered a pool")
        dtype, page_size, dim, page_bytes, device, regions = describe_pool(caches)
        mem_type, dev_id = _mem(device_name(device))
        spans = [(r.addr, (r.num_pages - 1) * r.page_stride + page_bytes, dev_id, "") for r in regions]
        try:
            self._reg = self._agent.register_memory(spans, mem_type)
        except Exception as e:
            raise TransferError(f"NIXL could not register the KV pool ({mem_type}): {e}") from e
        self._caches = list(caches)
        self._meta = PoolMetadata(
            backend=self.name,
            agent=self.agent_name,
            dtype=dtype,
            page_size=page_size,
            dim=dim,
            page_bytes=page_bytes,
            device=device_name(device),
            layers=regions,
            endpoint=self._agent.get_agent_metadata(),
        )
        log.info(
            "NIXL agent %s registered %d cache layers x %d pages (%s, %s)",
            self.agent_name,
            len(regions),
            regions[0].num_pages,
            self._meta.geometry(),
            mem_type,
        )

    def metadata(self) -> bytes:
        return encode_metadata(self._local())

    def connect(self, peer_agent: str, peer_metadata: bytes) -> None:
        old = self._peers.get(peer_agent)
        if old is not None and old.raw == peer_metadata:
            return
        meta = decode_metadata(peer_agent, peer_metadata)
        check_compatible(self._local(), meta, peer_agent)
        if old is not None:
            self._forget(peer_agent)
        try:
            added = self._agent.add_remote_agent(meta.endpoint)
        except Exception as e:
            raise TransferError(f"NIXL refused the metadata of peer {peer_agent!r}: {e}") from e
        added = added.decode() if isinstance(added, bytes) else str(added)
        if added != peer_agent:
            self._forget(added)
            raise TransferError(f"NIXL metadata given for peer {peer_agent!r} names agent {added!r}")
        try:
            self._agent.make_connection(peer_agent)
        except Exception as e:
            self._forget(peer_agent)
            raise TransferError(f"NIXL could not connect to peer {peer_agent!r}: {e}") from e
        mem_type, dev_id = _mem(meta.device)
        self._peers[peer_agent] = _Peer(meta, peer_metadata, mem_type, dev_id)
        log.info(
            "NIXL agent %s %s peer %s (%d layers x %d pages)",
            self.agent_name,
            "reconnected to" if old is not None else "connected to",
            peer_agent,
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
        rec = _NixlWrite(nbytes=len(src_pages) * local.page_bytes, peer=peer_agent)
        if not spans:
            rec.settle("done", self.stats)
            return rec
        self._open.add(rec)
        mem_type, dev_id = _mem(local.device)
        try:
            local_descs = self._agent.get_xfer_descs([(a, n, dev_id) for a, _, n in spans], mem_type)
            remote_descs = self._agent.get_xfer_descs(
                [(b, n, peer.dev_id) for _, b, n in spans], peer.mem_type
            )
            rec.xfer = self._agent.initialize_xfer("WRITE", local_descs, remote_descs, peer_agent)
            state = self._agent.transfer(rec.xfer)
        except Exception as e:
            log.warning("NIXL write of %s (%d pages) failed to start: %s", where, len(src_pages), e)
            state = "ERR"
        self._settle(rec, state)
        return rec

    def poll(self, handle: TransferHandle) -> TransferState:
        rec = self._own(handle)
        if rec.state == "pending":
            if self._closed:
                raise TransferError(f"NIXL agent {self.agent_name!r} is closed")
            try:
                state = self._agent.check_xfer_state(rec.xfer)
            except Exception as e:
                log.warning("NIXL write to peer %s failed: %s", rec.peer, e)
                state = "ERR"
            self._settle(rec, state)
        return rec.state

    def release(self, handle: TransferHandle) -> None:
        rec = self._own(handle)
        if rec.released:
            return
        if rec.state == "pending":
            raise TransferError("a pending write cannot be released (it cannot be cancelled): poll it first")
        self._drop(rec)

    def progress(self) -> None:
        self._agent.get_new_notifs()  # drives the UCX worker (no notifications are sent)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for rec in list(self._open):
            if rec.state == "pending":
                log.warning("NIXL agent %s closing with a write to %s in flight", self.agent_name, rec.peer)
            self._drop(rec)
        for peer in list(self._peers):
            self._forget(peer)
        if self._reg is not None:
            try:
                self._agent.deregister_memory(self._reg)
            except Exception as e:
                log.warning("NIXL agent %s could not deregister its pool: %s", self.agent_name, e)
        self._reg = None
        self._caches = []
        del self._agent
        log.info("NIXL agent %s closed", self.agent_name)

    # Helpers -----------------------------------------------------------------------------------
    def _local(self) -> PoolMetadata:
        if self._closed:
            raise TransferError(f"NIXL agent {self.agent_name!r} is closed")
        if self._meta is None:
            raise TransferError(
                f"agent {self.agent_name!r} has no registered pool (call register_pool first)"
            )
        return self._meta

    def _own(self, handle: TransferHandle) -> _NixlWrite:
        if not isinstance(handle, _NixlWrite):
            raise TransferError(f"{type(handle).__name__} is not a handle of the NIXL backend")
        return handle

    def _settle(self, rec: _NixlWrite, nixl_state: str) -> None:
        if nixl_state == "DONE":
            rec.settle("done", self.stats)
        elif nixl_state != "PROC":
            rec.settle("failed", self.stats)

    def _drop(self, rec: _NixlWrite) -> None:
        if rec.xfer is not None:
            try:
                self._agent.release_xfer_handle(rec.xfer)
            except Exception as e:
                log.warning("NIXL could not release a transfer handle to %s: %s", rec.peer, e)
        rec.xfer = None
        rec.released = True
        self._open.discard(rec)

    def _forget(self, peer_agent: str) -> None:
        self._peers.pop(peer_agent, None)
        try:
            self._agent.remove_remote_agent(peer_agent)
        except Exception as e:
            log.warning("NIXL agent %s could not remove peer %s: %s", self.agent_name, peer_agent, e)
