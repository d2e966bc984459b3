"""KV transfer between ranks (base.py has the contract); backends load through the registry."""

from dsinfer.transfer.base import TransferBackend, TransferError, TransferHandle, TransferState, TransferStats
from dsinfer.transfer.factory import TRANSFER_BACKENDS, make_transfer_backend

__all__ = [
    "TRANSFER_BACKENDS",
    "TransferBackend",
    "TransferError",
    "TransferHandle",
    "TransferState",
    "TransferStats",
    "make_transfer_backend",
]
