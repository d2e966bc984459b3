"""A pool's membership (elastic EP), kept in a torch.distributed FileStore its launcher owns.

The launcher keeps one store for its lifetime, in a directory only its user can enter (mode
0700): no socket, so no other local user can read or write it (a TCPStore, even on loopback,
answers any local client and has no credential). Each pool start (incarnation) has its keys
under its own prefix:

- ``members``: the latest membership, JSON ``{"generation": g, "ranks": [...]}`` (the original
  ranks of the pool, in the order of the group's ranks). Only ``change`` writes it, by
  compare-and-set: the launcher removes a rank that died, the pool's leader (its first member)
  adds a restarted rank that asked to rejoin. ``members/<g>`` keeps generation g's record.
- ``join/<rank>``: a restarted rank asks to rejoin, naming the members it expects the pool to
  have with it (it loaded its experts for that membership's placement).
- ``serving/<rank>``: the rank finished its start-up (warm-up) in the first generation: the
  launcher shrinks a pool only once every rank of it served (else it restarts it whole).
- ``gen<g>/...``: the process-group rendezvous of generation g (``group_store``): every
  generation's group is initialised afresh on its own prefix.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

__all__ = ["Membership", "PoolStore", "bound_store", "private_store"]

POLL = 0.02  # seconds between reads of a key another process is about to write


@dataclass(frozen=True)
class Membership:
    generation: int
    ranks: tuple[int, ...]  # original ranks, in the order of the group's ranks

    def encode(self) -> str:
        return json.dumps({"generation": self.generation, "ranks": list(self.ranks)})

    @classmethod
    def decode(cls, raw: bytes) -> Membership:
        data = json.loads(raw)
        return cls(int(data["generation"]), tuple(int(r) for r in data["ranks"]))

    def index(self, rank: int) -> int:
        return self.ranks.index(rank)


def private_store(timeout: float) -> tuple[dist.FileStore, str]:
    """The launcher's store and its file, in a new directory of mode 0700 (an elastic pool is on
    one node); the launcher removes the directory when it exits."""
    path = os.path.join(tempfile.mkdtemp(prefix="dsinfer-members-"), "store")
    return open_store(path, timeout), path


def open_store(path: str, timeout: float) -> dist.FileStore:
    store = dist.FileStore(path, -1)  # -1: never removed by torch, whoever opens or closes it
    store.set_timeout(timedelta(seconds=timeout))
    return store


def bound_store(host: str, port: int, timeout: float) -> tuple[dist.TCPStore, int]:
    """A master TCPStore that listens on ``host``'s address only (port 0: a free one) -> (store,
    port). The socket is bound here and handed over: torch's TCPStore alone binds every
    interface, where any host could write the rendezvous's keys."""
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(128)
        port = listener.getsockname()[1]
    except OSError:
        listener.close()
        raise
    store = dist.TCPStore(
        host,
        port,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=timeout),
        master_listen_fd=listener.detach(),  # the store serves on this descriptor from now on
    )
    return store, port


class PoolStore:
    def __init__(self, store: dist.Store, incarnation: str) -> None:
        self._store = dist.PrefixStore(incarnation, store)

    @classmethod
    def open(cls, path: str, incarnation: str, timeout: float) -> PoolStore:
        return cls(open_store(path, timeout), incarnation)

    # Membership -----------------------------------------------------------------------------------
    def start(self, num_ranks: int) -> Membership:
        first = Membership(0, tuple(range(num_ranks)))
        self._store.set("members/0", first.encode())
        self._store.set("members", first.encode())
        return first

    def members(self) -> Membership:
        return Membership.decode(self._store.get("members"))

    def record(self, generation: int, timeout: float) -> Membership:
        """Generation ``generation``'s record (written right after the change that made it)."""
        key = f"members/{generation}"
        deadline = time.monotonic() + timeout
        while not self._store.check([key]):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no record of membership generation {generation} after {timeout:g} s")
            time.sleep(POLL)
        return Membership.decode(self._store.get(key))

    def change(self, old: Membership, ranks: tuple[int, ...]) -> Membership | None:
        """The next generation with ``ranks``, if the latest is still ``old`` (else None)."""
        new = Membership(old.generation + 1, ranks)
        stored = self._store.compare_set("members", old.encode(), new.encode())
        if stored != new.encode().encode():
            return None
        self._store.set(f"members/{new.generation}", new.encode())
        return new

    # Rejoining ------------------------------------------------------------------------------------
    def ask_to_join(self, rank: int, ranks: tuple[int, ...]) -> None:
        self._store.set(f"join/{rank}", json.dumps(list(ranks)))

    def join_request(self, rank: int) -> tuple[int, ...] | None:
        key = f"join/{rank}"
        if not self._store.check([key]):
            return None
        return tuple(json.loads(self._store.get(key)))

    def withdraw_join(self, rank: int) -> None:
        self._store.delete_key(f"join/{rank}")

    # Start-up and groups --------------------------------------------------------------------------
    def mark_serving(self, rank: int) -> None:
        self._store.set(f"serving/{rank}", "1")

    def all_serving(self, num_ranks: int) -> bool:
        return self._store.check([f"serving/{r}" for r in range(num_ranks)])

    def group_store(self, generation: int) -> dist.Store:
        return dist.PrefixStore(f"gen{generation}", self._store)
