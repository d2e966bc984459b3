"""``make_transfer_backend``: a backend by name, importing its library only when asked for."""

from __future__ import annotations

from dsinfer.base.config import TRANSFER_BACKENDS
from dsinfer.transfer.base import TransferBackend, TransferError

__all__ = ["TRANSFER_BACKENDS", "make_transfer_backend"]


def make_transfer_backend(name: str, agent_name: str, *, host: str = "127.0.0.1") -> TransferBackend:
    """``host`` is the address peers reach this rank on (Mooncake; NIXL/UCX picks its own)."""
    if name == "nixl":
        try:
            from dsinfer.transfer.nixl import NixlBackend
        except ImportError as e:
            raise TransferError(f"transfer backend 'nixl' needs NIXL ({e}): pip install nixl-cu12") from e
        return NixlBackend(agent_name)
    if name == "mooncake":
        try:
            from dsinfer.transfer.mooncake import MooncakeBackend
        except ImportError as e:
            raise TransferError(
                f"transfer backend 'mooncake' needs Mooncake ({e}): pip install "
                "mooncake-transfer-engine-non-cuda (dsinfer[mooncake]) and apt-get install libibverbs1"
            ) from e
        return MooncakeBackend(agent_name, host=host)
    raise TransferError(f"unknown transfer backend {name!r}: choose one of {', '.join(TRANSFER_BACKENDS)}")
