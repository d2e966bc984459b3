"""KV transfer between ranks: the interface both backends (NIXL, Mooncake) implement.

A rank registers its KV pool once: per cache layer, the layer's cache tensors (each
[pages, rows, dim], every page contiguous: MLA's latent and, for V3.2, the indexer keys; V4's
layers differ, dsinfer/transfer/common.py);
``metadata()`` is everything a peer needs to write into that pool (agent info plus each cache's
base address and page stride) and travels in Register / PrefillRequest. The writer addresses
pages, not bytes: ``write_pages(peer, layer, src, dst)`` copies page ``src[i]`` of every cache of
its own ``layer`` into page ``dst[i]`` of the peer's, as one asynchronous transfer (contiguous
runs may be coalesced by the backend).

Contract:
- ``poll`` returns "done" only when the data is visible in the peer's memory, so a control
  message sent after "done" (PrefillDone over ZMQ) can never overtake the data.
- "failed" is final; the handle must still be released.
- A handle that is neither done nor failed can be waited on but never cancelled: fencing is
  the caller's job (the prefill side confirms an abort only after its handles finished).
- ``stats`` counts bytes of completed writes (pages x the layer's page bytes over its caches)
  and their wall time (start to done).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

TransferState = Literal["pending", "done", "failed"]


class TransferError(RuntimeError):
    pass


@dataclass
class TransferStats:
    bytes_written: int = 0
    seconds: float = 0.0  # summed start-to-done time of completed writes
    writes_done: int = 0
    writes_failed: int = 0


class TransferHandle:
    """Opaque to callers; backends subclass it."""


class TransferBackend(ABC):
    name: str

    def __init__(self, agent_name: str) -> None:
        self.agent_name = agent_name
        self.stats = TransferStats()

    @abstractmethod
    def register_pool(self, layers: Sequence[Sequence[torch.Tensor]]) -> None: ...

    @abstractmethod
    def metadata(self) -> bytes: ...

    @abstractmethod
    def connect(self, peer_agent: str, peer_metadata: bytes) -> None:
        """Idempotent for the same metadata; new metadata (the peer restarted) replaces the old."""

    @abstractmethod
    def write_pages(
        self, peer_agent: str, layer: int, src_pages: list[int], dst_pages: list[int]
    ) -> TransferHandle: ...

    @abstractmethod
    def poll(self, handle: TransferHandle) -> TransferState: ...

    @abstractmethod
    def release(self, handle: TransferHandle) -> None: ...

    def progress(self) -> None:  # noqa: B027 - backends with their own threads need nothing
        """Let the library make progress on this rank's side (a target must, for writers' remote
        completions to arrive). The rank loop calls it every iteration."""

    @abstractmethod
    def close(self) -> None: ...
