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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

try:  # the CUDA 13 build where it is installed (GPU machines: scripts/gpu-wheels), else CUDA 12's
    from nixl_cu13._api import nixl_agent, nixl_agent_config
except ImportError:
    from nixl_cu12._api import nixl_agent, nixl_agent_config

from dsinfer.transfer.base import TransferError, TransferHandle
from dsinfer.transfer.common import Peer, PoolBackend, PoolMetadata, WriteRecord

log = logging.getLogger("dsinfer.transfer")


@dataclass(eq=False)
class _NixlWrite(WriteRecord):
    xfer: Any = None


@dataclass(frozen=True)
class _Peer(Peer):
    mem_type: str
    dev_id: int


def _mem(device: str) -> tuple[str, int]:
    """NIXL memory type and device id of a pool's device name."""
    if device == "cpu":
        return "DRAM", 0
    return "VRAM", int(device.partition(":")[2] or 0)


class NixlBackend(PoolBackend[_Peer, _NixlWrite]):
    name = "nixl"
    label = "NIXL"
    write_type = _NixlWrite

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
        self._reg: Any = None

    # Registration and peers --------------------------------------------------------------------
    def _register(self, pool: PoolMetadata) -> bytes:
        mem_type, dev_id = _mem(pool.device)
        spans = [(addr, extent, dev_id, "") for addr, extent in pool.spans()]
        try:
            self._reg = self._agent.register_memory(spans, mem_type)
        except Exception as e:
            raise TransferError(f"NIXL could not register the KV pool ({mem_type}): {e}") from e
        return self._agent.get_agent_metadata()

    def _open_peer(self, peer_agent: str, meta: PoolMetadata, raw: bytes, replacing: bool) -> _Peer:
        if replacing:
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
        return _Peer(meta, raw, mem_type, dev_id)

    # Writes ------------------------------------------------------------------------------------
    def write_pages(
        self, peer_agent: str, layer: int, src_pages: list[int], dst_pages: list[int]
    ) -> TransferHandle:
        peer, spans, nbytes = self._resolve(peer_agent, layer, src_pages, dst_pages)
        rec = _NixlWrite(nbytes=nbytes, peer=peer_agent)
        if not spans:
            rec.settle("done", self.stats)
            return rec
        self._open.add(rec)
        mem_type, dev_id = _mem(self._local().device)
        try:
            local_descs = self._agent.get_xfer_descs([(a, n, dev_id) for a, _, n in spans], mem_type)
            remote_descs = self._agent.get_xfer_descs(
                [(b, n, peer.dev_id) for _, b, n in spans], peer.mem_type
            )
            rec.xfer = self._agent.initialize_xfer("WRITE", local_descs, remote_descs, peer_agent)
            state = self._agent.transfer(rec.xfer)
        except Exception as e:
            log.warning(
                "NIXL write of layer %d to peer %r (%d pages) failed to start: %s",
                layer,
                peer_agent,
                len(src_pages),
                e,
            )
            state = "ERR"
        self._settle(rec, state)
        return rec

    def _advance(self, rec: _NixlWrite) -> None:
        try:
            state = self._agent.check_xfer_state(rec.xfer)
        except Exception as e:
            log.warning("NIXL write to peer %s failed: %s", rec.peer, e)
            state = "ERR"
        self._settle(rec, state)

    def progress(self) -> None:
        self._agent.get_new_notifs()  # drives the UCX worker (no notifications are sent)

    def _shutdown(self) -> None:
        for rec in list(self._open):
            if rec.state == "pending":
                log.warning("NIXL agent %s closing with a write to %s in flight", self.agent_name, rec.peer)
            self._drop(rec)
        for peer in list(self._peers):
            self._forget(peer)
        if self._reg is not None:
            self._quietly("deregister its pool", self._agent.deregister_memory, self._reg)
        self._reg = None
        del self._agent

    # Helpers -----------------------------------------------------------------------------------
    def _settle(self, rec: _NixlWrite, nixl_state: str) -> None:
        if nixl_state == "DONE":
            rec.settle("done", self.stats)
        elif nixl_state != "PROC":
            rec.settle("failed", self.stats)

    def _drop(self, rec: _NixlWrite) -> None:
        if rec.xfer is not None:
            self._quietly(
                f"release a transfer handle to {rec.peer}", self._agent.release_xfer_handle, rec.xfer
            )
        rec.xfer = None
        super()._drop(rec)

    def _forget(self, peer_agent: str) -> None:
        self._peers.pop(peer_agent, None)
        self._quietly(f"remove peer {peer_agent}", self._agent.remove_remote_agent, peer_agent)

    def _quietly(self, what: str, call: Callable[..., object], *args: object) -> None:
        """A cleanup call whose failure is logged, not raised."""
        try:
            call(*args)
        except Exception as e:
            log.warning("NIXL agent %s could not %s: %s", self.agent_name, what, e)
