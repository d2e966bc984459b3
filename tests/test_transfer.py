"""KV transfer backends (NIXL, Mooncake) between two real processes.

This process is the writer; a peer is this file run as a script (``peer`` mode) in a child
process holding a registered PagedKVPool, answering page digests over stdin/stdout. Each pool layer
holds two caches (a latent and V3.2-style indexer keys of another width): a write of a layer's
pages moves both, and the byte counters count both. The digest is
asked for right after the writer's ``poll`` said "done", over a channel of its own, exactly as
decode reads pages after PrefillDone: the test holds the backends to "done = visible at the peer".
Every wait is bounded and every child is killed on every exit path.
"""

from __future__ import annotations

import hashlib
import json
import queue
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import msgspec
import pytest
import torch

from dsinfer.base.kv_spec import CacheComponent, KVCacheSpec
from dsinfer.cache.kv_pool import PagedKVPool
from dsinfer.model.batch import LayerCache
from dsinfer.transfer import TransferBackend, TransferError, TransferHandle, make_transfer_backend
from harness.children import JsonLinesChild, say

pytestmark = pytest.mark.system

BACKENDS = ("nixl", "mooncake")
DTYPES = ("float32", "bfloat16")
LAYERS, DIM, INDEX_DIM = 3, 40, 12  # pages of 64 tokens x (40 latent + 12 indexer values)
WRITER_PAGES, PEER_PAGES = 16, 24
WAIT_S = 20.0  # the most any single wait in this file takes
MARK = "@@dsinfer-peer "  # NIXL prints its own log lines on stdout


# The peer process --------------------------------------------------------------------------------
def spec(dtype: str, dim: int = DIM) -> KVCacheSpec:
    return KVCacheSpec((CacheComponent("latent", dim, dtype), CacheComponent("indexer", INDEX_DIM, dtype)))


def page_digests(layers: list[LayerCache] | list[tuple[torch.Tensor, ...]]) -> list[list[str]]:
    """Per layer, per page: a digest of the page's bytes in every cache of the layer."""
    caches = [layer.tensors() if isinstance(layer, LayerCache) else layer for layer in layers]
    return [
        [
            hashlib.blake2b(
                b"".join(c[p].contiguous().view(torch.uint8).numpy().tobytes() for c in layer), digest_size=8
            ).hexdigest()
            for p in range(layer[0].shape[0])
        ]
        for layer in caches
    ]


def peer_main(backend: str, pages: int, agents: list[str]) -> None:
    """One registered pool per ``name=dtype`` in ``agents``, each behind its own agent."""
    pools: dict[str, PagedKVPool] = {}
    txs: dict[str, TransferBackend] = {}
    for agent in agents:
        name, dtype = agent.split("=")
        pools[name] = PagedKVPool(LAYERS, pages, spec(dtype))
        txs[name] = make_transfer_backend(backend, name)
        txs[name].register_pool(pools[name].layer_tensors())

    say(MARK, {"metadata": {name: tx.metadata().hex() for name, tx in txs.items()}})
    lines: queue.Queue[str | None] = queue.Queue()

    def read_stdin() -> None:
        for line in sys.stdin:
            lines.put(line)
        lines.put(None)  # EOF: the test process is gone, so the peer ends too

    threading.Thread(target=read_stdin, daemon=True).start()
    while True:  # a target drives its library's progress, as a decode rank's loop does
        for tx in txs.values():
            tx.progress()
        try:
            line = lines.get(timeout=0.001)
        except queue.Empty:
            continue
        if line is None:
            break
        say(MARK, {"pages": page_digests(pools[json.loads(line)["digests"]].caches)})


class Peer(JsonLinesChild):
    """A child process with one registered pool per agent (name -> dtype); started without waiting."""

    def __init__(self, backend: str, agents: dict[str, str]) -> None:
        cmd = [sys.executable, __file__, "peer", backend, str(PEER_PAGES)]
        cmd += [f"{name}={dtype}" for name, dtype in agents.items()]
        self.agents = dict(agents)
        self._metadata: dict[str, bytes] = {}
        super().__init__(cmd, MARK, WAIT_S)

    def metadata(self, agent: str) -> bytes:
        if not self._metadata:
            self._metadata = {name: bytes.fromhex(md) for name, md in self.recv()["metadata"].items()}
        return self._metadata[agent]

    def digests(self, agent: str) -> list[list[str]]:
        return list(self.ask({"digests": agent})["pages"])


# Fixtures ----------------------------------------------------------------------------------------
def require(backend: str) -> None:
    if backend == "mooncake":
        try:
            import mooncake.engine  # noqa: F401
        except ImportError as e:
            pytest.skip(
                "Mooncake tests skipped because mooncake-transfer-engine-non-cuda (the optional "
                f"'mooncake' extra) or its libibverbs1 is not installed here: {e}"
            )


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@dataclass
class Pair:
    """The writer (in this process) connected to one peer agent, and what that agent's pool must hold."""

    tx: TransferBackend
    pool: PagedKVPool
    peer: Peer
    agent: str
    expect: list[tuple[torch.Tensor, ...]]  # per layer, per cache

    def write(self, layer: int, src: list[int], dst: list[int]) -> TransferHandle:
        handle = self.tx.write_pages(self.agent, layer, src, dst)
        for expected, cache in zip(self.expect[layer], self.pool.caches[layer].tensors(), strict=True):
            expected[dst] = cache[src]
        return handle

    def check(self) -> None:
        assert self.peer.digests(self.agent) == page_digests(self.expect)


def make_writer(backend: str, dtype: torch.dtype) -> tuple[TransferBackend, PagedKVPool]:
    pool = PagedKVPool(LAYERS, WRITER_PAGES, spec(str(dtype).removeprefix("torch.")))
    g = torch.Generator().manual_seed(0)
    for layer in pool.caches:
        for c in layer.tensors():
            c.copy_(torch.randn(c.shape, generator=g) + 1.0)
    tx = make_transfer_backend(backend, unique(f"writer-{backend}"))
    tx.register_pool(pool.layer_tensors())
    return tx, pool


def empty_like_peer(pool: PagedKVPool) -> list[tuple[torch.Tensor, ...]]:
    """What a fresh peer pool holds: zeros, per layer and cache."""
    return [
        tuple(torch.zeros(PEER_PAGES, *c.shape[1:], dtype=c.dtype) for c in layer.tensors())
        for layer in pool.caches
    ]


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    require(request.param)
    return request.param


@pytest.fixture(scope="module")
def peer(backend: str) -> Iterator[Peer]:
    """One peer process for the module, with a float32 and a bfloat16 pool."""
    proc = Peer(backend, {f"{backend}-{dtype}-{uuid.uuid4().hex[:8]}": dtype for dtype in DTYPES})
    try:
        yield proc
    finally:
        proc.kill()


@pytest.fixture(scope="module")
def pairs(backend: str, peer: Peer) -> Iterator[dict[str, Pair]]:
    """A writer per dtype, connected to the peer process's pool of that dtype."""
    made: dict[str, Pair] = {}
    try:
        for dtype in DTYPES:
            tx, pool = make_writer(backend, getattr(torch, dtype))
            agent = next(name for name, d in peer.agents.items() if d == dtype)
            made[dtype] = Pair(tx, pool, peer, agent, empty_like_peer(pool))
            tx.connect(agent, peer.metadata(agent))
        yield made
    finally:
        for p in made.values():
            p.tx.close()


def wait_all(tx: TransferBackend, handles: list[TransferHandle], timeout: float = WAIT_S) -> list[str]:
    deadline = time.monotonic() + timeout
    while True:
        states = [tx.poll(h) for h in handles]
        if "pending" not in states:
            return states
        if time.monotonic() > deadline:
            pytest.fail(f"writes still pending after {timeout:.0f} s: {states}")
        time.sleep(0.001)


# Tests -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_pages_land_byte_exact_at_their_destinations(pairs: dict[str, Pair], dtype: str) -> None:
    pair = pairs[dtype]
    page_bytes = 64 * (DIM + INDEX_DIM) * getattr(torch, dtype).itemsize  # a layer's page: both caches
    before = (pair.tx.stats.bytes_written, pair.tx.stats.writes_done)
    writes = [
        (0, [0, 1, 2, 3, 4], [8, 9, 10, 11, 12]),  # one run
        (1, [1, 3, 2, 7], [23, 0, 1, 9]),  # scattered, with a destination run of non-consecutive sources
        (2, [15, 14, 13], [3, 4, 5]),  # descending sources
        (2, [5], [23]),  # the peer's last page
        (0, [], []),
        (1, list(range(WRITER_PAGES)), [p + 8 for p in range(WRITER_PAGES)][::-1]),
    ]
    handles = [pair.write(layer, src, dst) for layer, src, dst in writes]
    assert wait_all(pair.tx, handles) == ["done"] * len(writes)
    pair.check()
    pages = sum(len(src) for _, src, _ in writes)
    assert pair.tx.stats.bytes_written - before[0] == pages * page_bytes
    assert pair.tx.stats.writes_done - before[1] == len(writes)
    assert pair.tx.stats.writes_failed == 0
    for h in handles:
        pair.tx.release(h)
        pair.tx.release(h)  # releasing twice is harmless


@pytest.mark.parametrize("dtype", DTYPES)
def test_connect_again_is_a_no_op_and_rewrites_land(pairs: dict[str, Pair], dtype: str) -> None:
    pair = pairs[dtype]
    pair.tx.connect(pair.agent, pair.peer.metadata(pair.agent))
    handle = pair.write(2, [6, 7], [0, 1])
    assert wait_all(pair.tx, [handle]) == ["done"]
    pair.check()
    pair.tx.release(handle)


@pytest.mark.parametrize("dtype", DTYPES)
def test_bad_pages_layers_and_peers_are_refused(pairs: dict[str, Pair], dtype: str) -> None:
    pair = pairs[dtype]
    tx, agent = pair.tx, pair.agent
    before = (tx.stats.writes_done, tx.stats.writes_failed)
    with pytest.raises(TransferError, match=f"destination page {PEER_PAGES} out of range"):
        tx.write_pages(agent, 0, [0, 1], [3, PEER_PAGES])
    with pytest.raises(TransferError, match="destination page -1 out of range"):
        tx.write_pages(agent, 0, [0], [-1])
    with pytest.raises(TransferError, match=f"source page {WRITER_PAGES} out of range"):
        tx.write_pages(agent, 0, [WRITER_PAGES], [0])
    with pytest.raises(TransferError, match=f"layer {LAYERS} out of range"):
        tx.write_pages(agent, LAYERS, [0], [0])
    with pytest.raises(TransferError, match="2 source pages but 1 destination"):
        tx.write_pages(agent, 0, [0, 1], [0])
    with pytest.raises(TransferError, match="not connected"):
        tx.write_pages("nobody", 0, [0], [0])
    assert (tx.stats.writes_done, tx.stats.writes_failed) == before
    pair.check()  # nothing landed


def test_mooncake_feeds_runs_beyond_its_in_flight_cap(backend: str, pairs: dict[str, Pair]) -> None:
    if backend != "mooncake":
        pytest.skip(
            "only the Mooncake backend submits one request per page run, because NIXL posts one per write"
        )
    from dsinfer.transfer.mooncake import MooncakeBackend

    pair = pairs["float32"]
    tx = MooncakeBackend(unique("capped"), max_in_flight=2)
    try:
        tx.register_pool(pair.pool.layer_tensors())
        tx.connect(pair.agent, pair.peer.metadata(pair.agent))
        capped = Pair(tx, pair.pool, pair.peer, pair.agent, pair.expect)
        handles = [
            capped.write(0, [0, 2, 4, 6, 8, 10], [23, 21, 19, 17, 15, 13]),
            capped.write(1, [1, 3, 5], [2, 6, 4]),
        ]
        assert wait_all(tx, handles) == ["done", "done"]
        assert tx.stats.bytes_written == 9 * 64 * (DIM + INDEX_DIM) * 4
        pair.check()
    finally:
        tx.close()


def test_mismatched_pools_are_refused_at_connect(backend: str) -> None:
    tx, _ = make_writer(backend, torch.float32)
    other = make_transfer_backend(backend, unique("odd"))
    try:
        with pytest.raises(TransferError, match="no registered pool"):
            other.metadata()
        other.register_pool(PagedKVPool(LAYERS, 4, spec("float32", DIM + 8)).layer_tensors())
        with pytest.raises(TransferError, match=r"pages are 64 tokens x \(float32 x 48 \+ float32 x 12\)"):
            tx.connect(other.agent_name, other.metadata())
        latent_only = make_transfer_backend(backend, unique("latent-only"))
        try:  # the same latent, no indexer cache: a dense model's pool
            latent_only.register_pool(
                [(t[0],) for t in PagedKVPool(LAYERS, 4, spec("float32")).layer_tensors()]
            )
            with pytest.raises(TransferError, match=r"pages are 64 tokens x \(float32 x 40\)"):
                tx.connect(latent_only.agent_name, latent_only.metadata())
        finally:
            latent_only.close()
        with pytest.raises(TransferError, match="belongs to agent"):
            tx.connect("someone-else", other.metadata())
        with pytest.raises(TransferError, match="not dsinfer transfer metadata"):
            tx.connect("garbage", b"\x00not msgpack")
        # the same pool as this rank's but for one field, as a peer of another build would send it
        own = msgspec.msgpack.decode(tx.metadata())
        bf16 = [
            [["bfloat16", rows, dim, size // 2] for _, rows, dim, size in caches]
            for caches in own["geometry"]
        ]
        for field, value, what in [
            ("geometry", bf16, r"pages are 64 tokens x \(bfloat16 x 40"),
            ("layers", own["layers"] * 2, f"has {2 * LAYERS} cache layers"),
            ("backend", "other", "uses transfer backend 'other'"),
        ]:
            with pytest.raises(TransferError, match=what):
                tx.connect(own["agent"], msgspec.msgpack.encode({**own, field: value}))
    finally:
        other.close()
        tx.close()


def test_dead_peer_fails_and_a_restarted_peer_is_reconnected(backend: str) -> None:
    name = unique(f"restarting-{backend}")
    started: list[Peer] = []
    tx, pool = make_writer(backend, torch.float32)
    try:
        first = Peer(backend, {name: "float32"})
        started.append(first)
        second = Peer(backend, {name: "float32"})  # the restarted peer: same name, new addresses
        started.append(second)
        tx.connect(name, first.metadata(name))
        assert wait_all(tx, [tx.write_pages(name, 0, [0, 1], [0, 1])]) == ["done"]

        first.kill()
        try:
            handle = tx.write_pages(name, 0, [2, 3], [2, 3])
        except TransferError:
            pass
        else:
            assert wait_all(tx, [handle]) == ["failed"]
            assert tx.stats.writes_failed == 1
            tx.release(handle)

        assert second.metadata(name) != first.metadata(name)
        tx.connect(name, second.metadata(name))
        expect = empty_like_peer(pool)
        handles = [tx.write_pages(name, layer, [5, 6, 9], [1, 2, 20]) for layer in range(LAYERS)]
        for layer, expected in zip(pool.caches, expect, strict=True):
            for c, e in zip(layer.tensors(), expected, strict=True):
                e[[1, 2, 20]] = c[[5, 6, 9]]
        assert wait_all(tx, handles) == ["done"] * LAYERS
        assert second.digests(name) == page_digests(expect)
    finally:
        tx.close()
        for p in started:
            p.kill()


def test_unknown_backend_and_missing_library_say_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(TransferError, match="unknown transfer backend 'rdma': choose one of nixl, mooncake"):
        make_transfer_backend("rdma", "x")
    monkeypatch.delitem(sys.modules, "dsinfer.transfer.nixl", raising=False)
    monkeypatch.setitem(sys.modules, "nixl_cu12._api", None)
    with pytest.raises(TransferError, match="pip install nixl-cu12") as info:
        make_transfer_backend("nixl", "x")
    assert "\n" not in str(info.value)
    monkeypatch.delitem(sys.modules, "dsinfer.transfer.mooncake", raising=False)
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)
    with pytest.raises(TransferError, match="pip install mooncake-transfer-engine-non-cuda"):
        make_transfer_backend("mooncake", "x")


if __name__ == "__main__":
    if sys.argv[1:2] == ["peer"]:
        peer_main(sys.argv[2], int(sys.argv[3]), sys.argv[4:])


def _hybrid_pool(pages: int, slots: int, fill: float) -> list[tuple[torch.Tensor, ...]]:
    """A pool whose layers differ, as DeepSeek-V4's: two caches of other rows and widths, a layer
    with none, and a layer of byte slots with a page count of its own."""
    return [
        (torch.full((pages, 4, 16), fill), torch.full((pages, 2, 8), fill + 1)),
        (),
        (torch.full((slots, 1, 100), int(fill) % 256, dtype=torch.uint8),),
    ]


def test_pools_whose_layers_differ() -> None:
    """Each layer has its own geometry and page count: pages of a layer land whole, a slot lands in
    its slot, a layer without caches has nothing to write, and another geometry is refused."""
    tx, rx = (make_transfer_backend("nixl", unique(f"hybrid-{side}")) for side in ("w", "r"))
    try:
        writer, reader = _hybrid_pool(8, 3, 3.0), _hybrid_pool(10, 4, 0.0)
        writer[0][0][1] = torch.arange(64, dtype=torch.float32).view(4, 16)
        tx.register_pool(writer)
        rx.register_pool(reader)
        tx.connect(rx.agent_name, rx.metadata())
        handles = [
            tx.write_pages(rx.agent_name, 0, [1, 2], [5, 6]),
            tx.write_pages(rx.agent_name, 2, [0], [3]),
        ]
        deadline = time.monotonic() + WAIT_S
        while any(tx.poll(h) == "pending" for h in handles):
            assert time.monotonic() < deadline, "hybrid writes did not complete"
            tx.progress()
            rx.progress()
        assert [tx.poll(h) for h in handles] == ["done", "done"]
        for h in handles:
            tx.release(h)
        assert torch.equal(reader[0][0][5:7], writer[0][0][1:3]) and torch.equal(
            reader[0][1][5:7], writer[0][1][1:3]
        )
        assert int(reader[0][0][4].abs().sum()) == 0 and torch.equal(reader[2][0][3], writer[2][0][0])
        assert tx.stats.bytes_written == 2 * (4 * 16 + 2 * 8) * 4 + 100
        with pytest.raises(TransferError, match="layer 1 has no caches"):
            tx.write_pages(rx.agent_name, 1, [0], [0])
        odd = make_transfer_backend("nixl", unique("hybrid-odd"))
        try:
            odd.register_pool([writer[0], (), (torch.zeros(3, 1, 64, dtype=torch.uint8),)])
            with pytest.raises(
                TransferError, match=r"1 layers of \(1 x uint8 x 64\)|1 tokens x \(uint8 x 64\)"
            ):
                tx.connect(odd.agent_name, odd.metadata())
        finally:
            odd.close()
    finally:
        tx.close()
        rx.close()
