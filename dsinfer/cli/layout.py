"""The pools of an all-in-one server (``dsinfer serve`` without ``--role``) and their ranks' threads."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from dsinfer.cli.errors import UsageError
from dsinfer.workers.args import shared_cores


@dataclass(frozen=True)
class PoolSpec:
    role: str
    pool_id: int
    size: int

    @property
    def name(self) -> str:
        return f"{self.role} pool {self.pool_id}"


@dataclass(frozen=True)
class Layout:
    """The pools of an all-in-one server and the torch threads of each of their ranks.

    All the ranks of the machine, of every role, share its cores. Under a steady load prefill
    and decode ranks compute at the same time, and ranks given more threads than their share of
    the cores wait on each other's spinning OpenMP threads: on 2 cores, 16 streams of the
    built-in model had requests stalled for 1-4 s (p90 latency 0.7-4.5 s) with both ranks on 2
    threads, none with one each (p90 0.5 s; no slower at one stream or with 64 arriving at once).
    ``--threads-per-rank`` sets them."""

    pools: tuple[PoolSpec, ...]
    threads: int  # torch threads of each rank

    @property
    def num_ranks(self) -> int:
        return sum(p.size for p in self.pools)


def layout_of(args: argparse.Namespace) -> Layout:
    for flag in ("prefill_pool_size", "decode_pool_size", "prefill_pools", "decode_pools"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if args.colocated:
        pools = tuple(PoolSpec("colocated", i, args.decode_pool_size) for i in range(args.decode_pools))
    else:
        pools = tuple(PoolSpec("prefill", i, args.prefill_pool_size) for i in range(args.prefill_pools))
        pools += tuple(PoolSpec("decode", i, args.decode_pool_size) for i in range(args.decode_pools))
    threads = args.threads_per_rank or shared_cores(sum(p.size for p in pools))
    return Layout(pools, threads)
