"""How a non-elastic pool's ranks meet when the launcher gives them a TCP address (a pool over
several nodes, or --dist-init-addr on one): rank 0's store listens on that address only, never on
every interface as torch's TCPStore alone would, and an address that is not the node's is a clear
error."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest

from dsinfer.base.processes import free_port
from dsinfer.workers.args import PoolArgs, RankArgs
from dsinfer.workers.membership import bound_store
from dsinfer.workers.rank import rendezvous

pytestmark = pytest.mark.system


def _listening(port: int) -> list[str]:
    conns = psutil.Process(os.getpid()).net_connections("inet")
    return [c.laddr.ip for c in conns if c.status == "LISTEN" and c.laddr.port == port]


def _rank(rank: int, addr: str) -> RankArgs:
    pool = PoolArgs(role="decode", pool_size=2, gateway_addr=f"127.0.0.1:{free_port()}", elastic_ep=False)
    return RankArgs(pool=pool, rank=rank, local_rank=rank, dist_init_addr=addr, incarnation="i")


def test_rank_zero_store_listens_on_the_given_address_only() -> None:
    port = free_port()
    leader = rendezvous(_rank(0, f"127.0.0.1:{port}"))["store"]
    assert _listening(port) == ["127.0.0.1"]
    follower = rendezvous(_rank(1, f"127.0.0.1:{port}"))["store"]
    follower.set("k", "v")
    assert leader.get("k") == b"v"


def test_bound_store_picks_a_free_port() -> None:
    store, port = bound_store("127.0.0.1", 0, 10)
    assert port > 0 and _listening(port) == ["127.0.0.1"]
    store.set("a", "b")
    assert store.get("a") == b"b"


def test_an_address_of_another_host_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match=r"rank 0 cannot listen on --dist-init-addr 192\.0\.2\.1:29500"):
        rendezvous(_rank(0, "192.0.2.1:29500"))  # TEST-NET-1: never an address of this machine


RANK = """
import sys, torch, torch.distributed as dist
from tests.test_rendezvous import _rank
from dsinfer.workers.rank import rendezvous
rank, addr = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", rank=rank, world_size=2, **rendezvous(_rank(rank, addr)))
x = torch.tensor([rank + 1.0])
dist.all_reduce(x)
print(int(x.item()))
dist.destroy_process_group()
"""


def test_two_ranks_form_a_group_on_it() -> None:
    addr = f"127.0.0.1:{free_port()}"
    procs = [
        subprocess.Popen([sys.executable, "-c", RANK, str(r), addr], stdout=subprocess.PIPE, text=True)
        for r in (0, 1)
    ]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0] and [o.strip() for o in outs] == ["3", "3"], outs
